"""Undo the value/layout changes llama.cpp's converter makes, so tensors equal the HF checkpoint's.

Each transform can `check` a tensor's shape against the config at open time, so a file that would
fail half-way through loading is refused before the first weight is yielded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.quantized import PackedTensor


class Transform(Protocol):
    def check(self, name: str, shape: tuple[int, ...], config: dict) -> None: ...

    def __call__(self, tensor: torch.Tensor, config: dict) -> torch.Tensor: ...

    def packed(self, tensor: PackedTensor, config: dict) -> PackedTensor | None:
        """The transform applied to a packed tensor without decoding it, or None when it cannot be."""
        ...


class _DenseOnly:
    """A transform that changes values (or a layout the blocks cannot follow): packed tensors are decoded first."""

    def packed(self, tensor: PackedTensor, config: dict) -> PackedTensor | None:
        return None


@dataclass(frozen=True)
class UnpermuteRope:
    """llama.cpp interleaves each q/k head's rows into rotary pairs (GPT-J rope); HF keeps the two halves.

    `heads_key` is the config key giving the head count of this projection (q or kv heads).
    """

    heads_key: str

    def check(self, name: str, shape: tuple[int, ...], config: dict) -> None:
        heads = config[self.heads_key]
        expected = heads * config["head_dim"]
        if shape[0] != expected:
            raise UnsupportedCheckpointError(
                f"tensor {name!r} has {shape[0]} rows; expected {self.heads_key} * head_dim = {expected}")

    def __call__(self, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        heads = config[self.heads_key]
        pairs = tensor.shape[0] // heads // 2
        return tensor.reshape(heads, pairs, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)

    def packed(self, tensor: PackedTensor, config: dict) -> PackedTensor:
        tensor.data = self(tensor.data, config)  # whole rows move: the blocks stay as they are
        return tensor


@dataclass(frozen=True)
class SubtractOffset(_DenseOnly):
    """llama.cpp stores Gemma RMSNorm weights as `offset + w` (its norm multiplies by the weight); HF stores `w`."""

    offset: float = 1.0
    def check(self, name: str, shape: tuple[int, ...], config: dict) -> None:
        return None

    def __call__(self, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        return tensor - self.offset


@dataclass(frozen=True)
class AsRow(_DenseOnly):
    """Older llama.cpp converters squeezed [1, n] weights (Qwen2-MoE's shared-expert gate) to [n]."""

    def check(self, name: str, shape: tuple[int, ...], config: dict) -> None:
        return None

    def __call__(self, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        return tensor.reshape(1, -1)


@dataclass(frozen=True)
class Flatten(_DenseOnly):
    """llama.cpp's Mamba2 converter reshapes D to [heads, 1] and the mixer norm to [groups, inner / groups]."""

    def check(self, name: str, shape: tuple[int, ...], config: dict) -> None:
        return None

    def __call__(self, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        return tensor.reshape(-1)


@dataclass(frozen=True)
class ChannelConv(_DenseOnly):
    """Depthwise conv weights: the converter squeezes HF's [channels, 1, kernel] to [channels, kernel]."""

    def check(self, name: str, shape: tuple[int, ...], config: dict) -> None:
        if len(shape) not in (2, 3):
            raise UnsupportedCheckpointError(f"tensor {name!r} has shape {shape}; expected [channels, kernel]")

    def __call__(self, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        return tensor.reshape(tensor.shape[0], 1, tensor.shape[-1])


@dataclass(frozen=True)
class NegExpToLog(_DenseOnly):
    """Mamba2's A: the converter stores A = -exp(A_log) as [heads, 1]; HF keeps A_log [heads]."""

    def check(self, name: str, shape: tuple[int, ...], config: dict) -> None:
        return None

    def __call__(self, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        return torch.log(-tensor.double()).to(tensor.dtype).reshape(-1)


@dataclass(frozen=True)
class UntileValueHeads:
    """Qwen3.5's converter reorders the Gated DeltaNet's value heads along one axis from grouped by key
    head (HF: key head k's r value heads together) to tiled (value head j of every key head, then j + 1),
    for ggml's broadcast; this puts them back. `per_head`: values per head along the axis, "value"
    (linear_value_head_dim) or "one" (b, a, A, dt_bias); `skip_qk`: the q and k channels ahead of the
    values (in_proj_qkv, the conv) stay where they are."""

    axis: int  # 0: rows (and 1-D tensors), 1: columns (out_proj)
    per_head: str
    skip_qk: bool = False

    def order(self, config: dict) -> torch.Tensor:
        """For each HF position along the axis, the file position that holds it."""
        keys, values = config["linear_num_key_heads"], config["linear_num_value_heads"]
        width = config["linear_value_head_dim"] if self.per_head == "value" else 1
        tiled = torch.arange(values * width).reshape(values // keys, keys, width).transpose(0, 1).reshape(-1)
        skip = 2 * keys * config["linear_key_head_dim"] if self.skip_qk else 0
        return torch.cat([torch.arange(skip), skip + tiled])

    def check(self, name: str, shape: tuple[int, ...], config: dict) -> None:
        keys, values = config["linear_num_key_heads"], config["linear_num_value_heads"]
        if keys <= 0 or values % keys:
            raise UnsupportedCheckpointError(
                f"tensor {name!r}: linear_num_value_heads {values} must be a multiple of linear_num_key_heads {keys}")
        expected = len(self.order(config))
        if len(shape) <= self.axis or shape[self.axis] != expected:
            raise UnsupportedCheckpointError(
                f"tensor {name!r} has shape {shape}; expected {expected} along axis {self.axis} "
                f"(the Gated DeltaNet's value heads)")

    def __call__(self, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        return tensor.index_select(self.axis, self.order(config))

    def packed(self, tensor: PackedTensor, config: dict) -> PackedTensor:
        order = self.order(config)
        if self.axis == 0:
            tensor.data = tensor.data.index_select(0, order)
        else:  # the blocks keep the file's column order; the matmul permutes the activation to match
            tensor.input_perm = torch.argsort(order)
        return tensor


@dataclass(frozen=True)
class Chain:
    """Several transforms in order (a reordered conv that is also squeezed, a reordered A)."""

    steps: tuple[Transform, ...]

    def check(self, name: str, shape: tuple[int, ...], config: dict) -> None:
        for step in self.steps:
            step.check(name, shape, config)

    def __call__(self, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        for step in self.steps:
            tensor = step(tensor, config)
        return tensor

    def packed(self, tensor: PackedTensor, config: dict) -> PackedTensor | None:
        for step in self.steps:
            if (tensor := step.packed(tensor, config)) is None:
                return None
        return tensor


@dataclass(frozen=True)
class UninterleaveBetaAlpha:
    """Qwen3-Next's in_proj_ba, which its converter keeps as HF has it: per key head [b (r rows) | a (r rows)];
    regrouped to [b of every head | a of every head], the order the split in_proj_b / in_proj_a take."""

    def order(self, config: dict) -> torch.Tensor:
        keys, values = config["linear_num_key_heads"], config["linear_num_value_heads"]
        return torch.arange(2 * values).reshape(keys, 2, values // keys).transpose(0, 1).reshape(-1)

    def check(self, name: str, shape: tuple[int, ...], config: dict) -> None:
        keys, values = config["linear_num_key_heads"], config["linear_num_value_heads"]
        if keys <= 0 or values % keys or shape[0] != 2 * values:
            raise UnsupportedCheckpointError(
                f"tensor {name!r} has {shape[0]} rows; expected 2 * linear_num_value_heads = {2 * values}, "
                f"with linear_num_value_heads a multiple of linear_num_key_heads {keys}")

    def __call__(self, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        return tensor.index_select(0, self.order(config))

    def packed(self, tensor: PackedTensor, config: dict) -> PackedTensor:
        tensor.data = tensor.data.index_select(0, self.order(config))
        return tensor
