"""Activations by their config names; unknown names are refused with the list."""
from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F

from vllmpy.errors import UnsupportedCheckpointError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise UnsupportedCheckpointError(
            f"activation {name!r} (config hidden_act / hidden_activation) is not supported; "
            f"supported: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


def gated(act: Callable[[torch.Tensor], torch.Tensor], gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up for a fused [.., 2 * inter] gate_up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up
