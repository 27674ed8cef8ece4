"""Activations by their config names; unknown names are refused with the list."""
from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.kernels import layer_kernels


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's sigmoid approximation of GELU."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "relu": F.relu,
    "quick_gelu": _quick_gelu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise UnsupportedCheckpointError(
            f"activation {name!r} (config hidden_act / hidden_activation) is not supported; "
            f"supported: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


# Activations the C kernel fuses with the gate product, by its act code.
_KERNEL_ACTS = {F.silu: 0, _gelu_tanh: 1}


def gated(act: Callable[[torch.Tensor], torch.Tensor], gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up for a fused [.., 2 * inter] gate_up projection: one C pass on CPU float32 or bfloat16
    (computed in float32, rounded once) for SiLU and tanh-GELU (torch makes three; the results differ in the
    last bits), else torch."""
    code = _KERNEL_ACTS.get(act)
    on_cpu = gate_up.device.type == "cpu" and gate_up.dtype in (torch.float32, torch.bfloat16)
    lib = layer_kernels() if code is not None and on_cpu else None
    if lib is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
    kernel = lib.vq_gated_act if gate_up.dtype == torch.float32 else lib.vq_gated_act_bf16
    kernel(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter, code, torch.get_num_threads())
    return out
