"""Dense linear layers whose parameters know how to load checkpoint shards (`weight_loader`)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from vllmpy.layers.dense import dense_linear
from vllmpy.layers.quantized import PackedTensor, packed_linear

WeightLoader = Callable[[nn.Parameter, torch.Tensor, "int | str | None"], None]
LinearDelta = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def release(param: nn.Parameter) -> None:
    """Drop a dense parameter's storage once a packed copy of the weight serves it."""
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


class Linear(nn.Module):
    """y = x W^T (+ b): a plain parameter the default loader fills, or GGML blocks kept packed."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: PackedTensor | None = None
        self.in_features, self.out_features = in_features, out_features
        # (x, y) -> y plus this step's LoRA deltas, set on every adaptable layer when --enable-lora (vllmpy/lora)
        self.lora: LinearDelta | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            y = packed_linear(x, self.packed, self.bias)
        else:
            y = dense_linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora(x, y)

    def load_packed(self, weight: PackedTensor, shard_id: int | str | None = None) -> None:
        if weight.shape != tuple(self.weight.shape):
            raise ValueError(f"shape mismatch: parameter {tuple(self.weight.shape)} vs checkpoint {weight.shape}")
        self.packed = weight
        release(self.weight)


class MergedLinear(Linear):
    """Several projections of one input fused along the output dim (qkv, gate_up).

    Checkpoints store them split; the module's `weight_loader(param, tensor, shard_id)` copies each
    split into its row range so one matmul serves all of them. (It lives on the module, not the
    parameter: moving a meta-built model to a device replaces parameter objects.)
    """

    def __init__(self, in_features: int, shard_sizes: dict[int | str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.in_features = in_features
        self.shard_offsets: dict[int | str, tuple[int, int]] = {}
        offset = 0
        for shard, size in shard_sizes.items():
            self.shard_offsets[shard] = (offset, size)
            offset += size
        self.packed_shards: dict[int | str, PackedTensor] = {}
        self.segments: list[PackedTensor] = []

    def load_packed(self, weight: PackedTensor, shard_id: int | str | None = None) -> None:
        """Packed shards are fused once all have arrived (`finish_loading`); a fused file tensor is whole."""
        if shard_id is None:
            super().load_packed(weight)
            return
        size = self.shard_offsets[shard_id][1]
        if weight.shape != (size, self.in_features):
            raise ValueError(f"shape mismatch for shard {shard_id!r}: parameter {(size, self.in_features)} "
                             f"vs checkpoint {weight.shape}")
        self.packed_shards[shard_id] = weight

    def finish_loading(self) -> None:
        """Fuse the packed shards: consecutive shards of one block type become one weight (one kernel
        call for q/k/v when they share a type). If some shards came dense, expand the packed ones."""
        if not self.packed_shards:
            return
        shards = [self.packed_shards.get(shard) for shard in self.shard_offsets]
        if any(shard is None for shard in shards):
            for shard, packed in self.packed_shards.items():
                offset, size = self.shard_offsets[shard]
                self.weight.data.narrow(0, offset, size).copy_(packed.dequantize())
        else:
            segments = [shards[0]]
            for shard in shards[1:]:
                if segments[-1].fuses_with(shard):
                    segments[-1] = segments[-1].concat(shard)
                else:
                    segments.append(shard)
            self.segments = segments
            self.packed = segments[0] if len(segments) == 1 else None
            release(self.weight)
        self.packed_shards = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.segments) > 1:
            y = packed_linear(x, self.segments, self.bias)
            return y if self.lora is None else self.lora(x, y)
        return super().forward(x)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None) -> None:
        if shard_id is None:  # the checkpoint stores them fused already (Phi-3, GLM-4, GPT-2)
            default_weight_loader(param, loaded)
            return
        offset, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch for shard {shard_id!r}: parameter {tuple(target.shape)} "
                             f"vs checkpoint {tuple(loaded.shape)}")
        target.copy_(loaded)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return list(y.split([size for _, size in self.shard_offsets.values()], dim=-1))
