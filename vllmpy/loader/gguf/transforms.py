"""Undo the value/layout changes llama.cpp's converter makes, so tensors equal the HF checkpoint's.

Each transform can `check` a tensor's shape against the config at open time, so a file that would
fail half-way through loading is refused before the first weight is yielded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from vllmpy.errors import UnsupportedCheckpointError


class Transform(Protocol):
    # True when the transform only reorders whole rows, so it applies to packed blocks unchanged.
    rows_only: bool

    def check(self, name: str, shape: tuple[int, ...], config: dict) -> None: ...

    def __call__(self, tensor: torch.Tensor, config: dict) -> torch.Tensor: ...


@dataclass(frozen=True)
class UnpermuteRope:
    """llama.cpp interleaves each q/k head's rows into rotary pairs (GPT-J rope); HF keeps the two halves.

    `heads_key` is the config key giving the head count of this projection (q or kv heads).
    """

    heads_key: str
    rows_only: bool = True

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


@dataclass(frozen=True)
class SubtractOffset:
    """llama.cpp stores Gemma RMSNorm weights as `offset + w` (its norm multiplies by the weight); HF stores `w`."""

    offset: float = 1.0
    rows_only: bool = False

    def check(self, name: str, shape: tuple[int, ...], config: dict) -> None:
        return None

    def __call__(self, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        return tensor - self.offset


@dataclass(frozen=True)
class AsRow:
    """Older llama.cpp converters squeezed [1, n] weights (Qwen2-MoE's shared-expert gate) to [n]."""

    rows_only: bool = False

    def check(self, name: str, shape: tuple[int, ...], config: dict) -> None:
        return None

    def __call__(self, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        return tensor.reshape(1, -1)


@dataclass(frozen=True)
class Flatten:
    """llama.cpp's Mamba2 converter reshapes D to [heads, 1] and the mixer norm to [groups, inner / groups]."""

    rows_only: bool = False

    def check(self, name: str, shape: tuple[int, ...], config: dict) -> None:
        return None

    def __call__(self, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        return tensor.reshape(-1)


@dataclass(frozen=True)
class ChannelConv:
    """Depthwise conv weights: the converter squeezes HF's [channels, 1, kernel] to [channels, kernel]."""

    rows_only: bool = False

    def check(self, name: str, shape: tuple[int, ...], config: dict) -> None:
        if len(shape) not in (2, 3):
            raise UnsupportedCheckpointError(f"tensor {name!r} has shape {shape}; expected [channels, kernel]")

    def __call__(self, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        return tensor.reshape(tensor.shape[0], 1, tensor.shape[-1])


@dataclass(frozen=True)
class NegExpToLog:
    """Mamba2's A: the converter stores A = -exp(A_log) as [heads, 1]; HF keeps A_log [heads]."""

    rows_only: bool = False

    def check(self, name: str, shape: tuple[int, ...], config: dict) -> None:
        return None

    def __call__(self, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        return torch.log(-tensor.double()).to(tensor.dtype).reshape(-1)
