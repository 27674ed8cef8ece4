"""Dense matmul on CPU through torch's oneDNN linear.

torch.mm / F.linear reach BLAS (MKL in torch's x86 wheels), which runs its AVX2 code on AMD CPUs: on
the EPYC the benchmarks ran on that is 105 GFLOP/s per core, against 230 for oneDNN's AVX-512
kernels on the same float32 inputs (single rows of large weights gain ~15% too; small products keep
F.linear, which sets up faster). oneDNN picks its kernels by the CPU's instruction set on Intel and
AMD alike. Other devices, dtypes and builds keep F.linear.
"""
from __future__ import annotations

import platform

import torch
from torch.nn import functional as F

_ONEDNN = (platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()
           and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
onednn_linear = torch.ops.mkldnn._linear_pointwise if _ONEDNN else None
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
# Multiply-adds below which F.linear wins: oneDNN spends ~14 us per call setting up its kernel.
_ONEDNN_MIN_MACS = 1 << 21


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias), the same contract as F.linear."""
    if (onednn_linear is not None and x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype) and weight.dim() == 2
            and x.numel() // x.shape[-1] * weight.numel() >= _ONEDNN_MIN_MACS):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = onednn_linear(x2, weight.contiguous(), bias, "none", [], "")
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
