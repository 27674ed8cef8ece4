"""LFM2's short convolution mixer: y = out_proj(C * conv(B * x)), with (B, C, x) = in_proj(h).

A depthwise causal conv over `conv_L_cache` taps, no activation; per seat it keeps the last
conv_L_cache - 1 gated inputs B * x (model dtype). No SSM state: the conv window is all it carries.
"""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.gated_delta_net import causal_conv1d, causal_conv1d_step
from vllmpy.layers.linear import Linear
from vllmpy.layers.recurrent_kernels import conv_update, decode_kernels
from vllmpy.layers.recurrent_state import RecurrentMetadata, RecurrentState, RecurrentStateSpec


class ShortConv(nn.Module):
    def __init__(self, hidden: int, kernel: int, bias: bool) -> None:
        super().__init__()
        if kernel < 2:
            raise UnsupportedCheckpointError(f"config conv_L_cache={kernel} must be >= 2")
        self.hidden = hidden
        self.in_proj = Linear(hidden, 3 * hidden, bias=bias)
        self.conv = nn.Module()
        self.conv.weight = nn.Parameter(torch.empty(hidden, 1, kernel), requires_grad=False)
        self.conv.bias = nn.Parameter(torch.empty(hidden), requires_grad=False) if bias else None
        self.out_proj = Linear(hidden, hidden, bias=bias)

    def recurrent_state_spec(self, ssm_dtype: torch.dtype) -> RecurrentStateSpec:
        """The conv window only (ssm_dtype has nothing to apply to)."""
        return RecurrentStateSpec(((self.conv.weight.shape[-1] - 1, self.hidden),), (self.conv.weight.dtype,),
                                  label="short conv")

    def forward(self, x: torch.Tensor, state: RecurrentState, meta: RecurrentMetadata) -> torch.Tensor:
        (conv_states,) = state
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        if not meta.prefill_rows and (lib := decode_kernels(conv_states)) is not None:  # the seats shift in place
            return self.out_proj(c * conv_update(lib, b * h, self.conv.weight[:, 0], self.conv.bias, conv_states,
                                                 meta.seat_ids, silu=False).to(c.dtype))
        weight, windows = self.conv.weight[:, 0], conv_states.index_select(0, meta.seat_ids)
        if meta.prefill_rows:
            meta.store_windows(conv_states, windows, b * h)
            y, new = causal_conv1d(b * h, weight, self.conv.bias, windows, meta.query_start_loc)
        else:
            y, new = causal_conv1d_step(b * h, weight, self.conv.bias, windows)
        conv_states.index_copy_(0, meta.seat_ids, new.to(conv_states.dtype))
        return self.out_proj(c * y)
