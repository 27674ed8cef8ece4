"""The recurrent layers' decode steps through the C kernels (vllmpy/kernels/recurrent_ops.c): a step whose chunks
are all single tokens updates each row's seat in place in one call per update (conv window, Mamba2 SSM state,
gated delta-rule state) instead of gathering, widening and scattering the seats with ~25 torch ops.

`decode_kernels` says when they apply: CPU tensors, seat states float32 or bf16, and a library that built;
everywhere else (other devices, float16 states, no C compiler) the layers keep their torch ops. Inputs are
read as float32 with a row stride (column slices of the fused projection pass without a copy; bf16 inputs are
widened first) and outputs are float32.
"""
from __future__ import annotations

import ctypes

import torch

from vllmpy.kernels import recurrent_kernels

STATE_DTYPES = (torch.float32, torch.bfloat16)


def decode_kernels(*states: torch.Tensor) -> ctypes.CDLL | None:
    """The kernel library when every seat tensor is a contiguous CPU tensor in a dtype it updates, else None."""
    if all(s.device.type == "cpu" and s.dtype in STATE_DTYPES and s.is_contiguous() for s in states):
        return recurrent_kernels()
    return None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as float32 rows of unit column stride (views kept, anything else copied once)."""
    t = t.float()
    return t if t.stride(-1) == 1 else t.contiguous()


def _params(*params: torch.Tensor) -> list[torch.Tensor]:
    return [p.float().contiguous() for p in params]


def conv_update(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                states: torch.Tensor, seats: torch.Tensor, silu: bool) -> torch.Tensor:
    """x [B, C] one new input per row, weight [C, W], states [S, W - 1, C] (row i's window at seats[i], shifted
    in place) -> the conv output [B, C] float32, SiLU'd when `silu`."""
    x = _rows(x)
    (weight,) = _params(weight)
    bias = _params(bias)[0] if bias is not None else None
    rows, channels = x.shape
    out = torch.empty(rows, channels, dtype=torch.float32)
    lib.vq_conv_update(x.data_ptr(), x.stride(0), states.data_ptr(), int(states.dtype == torch.bfloat16),
                       seats.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None,
                       out.data_ptr(), rows, channels, weight.shape[1], int(silu), torch.get_num_threads())
    return out


def mamba2_step(lib: ctypes.CDLL, xbc: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
                d_skip: torch.Tensor, states: torch.Tensor, seats: torch.Tensor, groups: int) -> torch.Tensor:
    """xbc [B, H*P + 2*G*N] float32 rows ([x | B | C], the SiLU'd conv output), dt [B, H] before its softplus,
    states [S, H, P, N] (row i's at seats[i], updated in place) -> y [B, H, P] float32 with the D skip."""
    rows = xbc.shape[0]
    heads, head_dim, d_state = states.shape[1:]
    x, b, c = xbc.split([heads * head_dim, groups * d_state, groups * d_state], dim=-1)
    dt = _rows(dt)
    dt_bias, a_log, d_skip = _params(dt_bias, a_log, d_skip)
    y = torch.empty(rows, heads, head_dim, dtype=torch.float32)
    lib.vq_mamba2_step(x.data_ptr(), b.data_ptr(), c.data_ptr(), xbc.stride(0), dt.data_ptr(), dt.stride(0),
                       dt_bias.data_ptr(), a_log.data_ptr(), d_skip.data_ptr(), states.data_ptr(),
                       int(states.dtype == torch.bfloat16), seats.data_ptr(), y.data_ptr(), rows, heads, head_dim,
                       groups, d_state, torch.get_num_threads())
    return y


def gated_delta_step(lib: ctypes.CDLL, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                     dt_bias: torch.Tensor, states: torch.Tensor, seats: torch.Tensor, k_heads: int,
                     k_dim: int) -> torch.Tensor:
    """mixed [B, 2*Hk*Dk + Hv*Dv] float32 rows ([q | k | v], the SiLU'd conv output), a and b [B, Hv] raw (decay
    and write-strength inputs), states [S, Hv, Dk, Dv] (row i's at seats[i], updated in place) -> out [B, Hv, Dv]
    float32; q and k are l2-normalized (q scaled by Dk^-1/2) in the kernel."""
    rows, (v_heads, _, v_dim) = mixed.shape[0], states.shape[1:]
    a, b = _rows(a), _rows(b)
    a_log, dt_bias = _params(a_log, dt_bias)
    out = torch.empty(rows, v_heads, v_dim, dtype=torch.float32)
    lib.vq_gated_delta_step(mixed.data_ptr(), mixed.stride(0), a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0),
                            a_log.data_ptr(), dt_bias.data_ptr(), states.data_ptr(),
                            int(states.dtype == torch.bfloat16), seats.data_ptr(), out.data_ptr(), rows, k_heads,
                            v_heads, k_dim, v_dim, k_dim ** -0.5, torch.get_num_threads())
    return out
