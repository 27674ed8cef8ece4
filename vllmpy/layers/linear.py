"""Dense linear layers whose parameters know how to load checkpoint shards (`weight_loader`)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

WeightLoader = Callable[[nn.Parameter, torch.Tensor, "int | str | None"], None]


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T (+ b); a plain parameter the default loader fills."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of one input fused along the output dim (qkv, gate_up).

    Checkpoints store them split; the module's `weight_loader(param, tensor, shard_id)` copies each
    split into its row range so one matmul serves all of them. (It lives on the module, not the
    parameter: moving a meta-built model to a device replaces parameter objects.)
    """

    def __init__(self, in_features: int, shard_sizes: dict[int | str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[int | str, tuple[int, int]] = {}
        offset = 0
        for shard, size in shard_sizes.items():
            self.shard_offsets[shard] = (offset, size)
            offset += size

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
