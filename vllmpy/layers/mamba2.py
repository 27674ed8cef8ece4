"""The Mamba2 mixer (Mamba2, Granite 4.0-H, Bamba, Nemotron-H): in_proj, causal conv1d, SSD scan, gated
RMSNorm, out_proj, over a flat batch whose sequences continue from their seats (layers/recurrent_state.py).

Per head h the state S [head_dim, d_state] evolves per token as S <- exp(dt A_h) S + dt x B^T and the
output reads y = S C + D x. A prefill runs the SSD chunked form (state-space duality: within a chunk
the recurrence is a masked matmul, a decayed state passes chunk to chunk); a decode row runs that step
once. transformers' `torch_forward` (chunk scan for prompts, selective state update for one token) is
the reference; both compute in float32 and the seat keeps S in --mamba-ssm-cache-dtype.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from vllmpy.layers.activation import get_activation
from vllmpy.layers.gated_delta_net import causal_conv1d, causal_conv1d_step
from vllmpy.layers.linear import Linear
from vllmpy.layers.recurrent_kernels import conv_update, decode_kernels, mamba2_step
from vllmpy.layers.recurrent_state import RecurrentMetadata, RecurrentState, RecurrentStateSpec


# The prefill scan's chunk: at most this, else the config's chunk_size (the result does not depend on it).
# Its c^2 within-chunk work and its L/c state passes balance near sqrt(head_dim * d_state); measured on the
# loaded 2-core dev host, one Granite-4.0-H-350M-like layer (48 heads x 32, d_state 128), 512 tokens:
# chunk 256 1.03 s, 128 0.56 s, 64 1.24 s.
MAX_SCAN_CHUNK = 128


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   state: torch.Tensor, chunk: int, save_at: Sequence[int] = (),
                   saved: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [L, H, P], dt [L, H] (after softplus), a [H] (negative), b, c [L, G, N], state
    [H, P, N] -> (y [L, H, P] float32 without the D skip, final state [H, P, N] float32). For each o in
    `save_at` (1..L) the state after the first o tokens is appended to `saved` (snapshots, verification).

    B and C stay per group (head h reads group h // (H / G)): their products are computed once per
    group, not per head. The decay between positions s <= l of a chunk is exp(cum_l - cum_s) over the
    chunk-local cumulative log decay, as mamba_ssm's and vLLM's kernels take it. The tail is padded with
    dt = 0, which decays nothing and writes nothing, so the final state is the state after the last token.
    """
    length, heads, head_dim = x.shape
    groups, size = b.shape[1:]
    per = heads // groups
    pad = -length % chunk
    n = (length + pad) // chunk
    dt = dt.float()
    x, b, c, decay = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).reshape(n, chunk, *t.shape[1:])
                      for t in (x.float() * dt.unsqueeze(-1), b.float(), c.float(), dt * a.float()))
    cum = decay.cumsum(1)  # [n, c, H]: log decay from the chunk's start through each position
    heads_cum = cum.transpose(1, 2)  # [n, H, c]: the within-chunk matrices are built heads-first, no permutes
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    mask = (heads_cum.unsqueeze(-1) - heads_cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    scores = torch.einsum("nlgk,nsgk->ngls", c, b).unsqueeze(2)  # [n, G, 1, l, s]: once per group
    scores = (scores * mask.view(n, groups, per, chunk, chunk)).view(n, heads, chunk, chunk)
    y = (scores @ x.transpose(1, 2)).transpose(1, 2)  # [n, l, H, P]
    to_end = (x * torch.exp(cum[:, -1:] - cum).unsqueeze(-1)).view(n, chunk, groups, per, head_dim)
    chunk_states = torch.einsum("nlgqp,nlgk->ngqpk", to_end, b).reshape(n, heads, head_dim, size)
    chunk_decay = torch.exp(cum[:, -1])  # [n, H]
    starts = []
    s = state.float()
    for i in range(n):
        starts.append(s)
        s = s * chunk_decay[i][:, None, None] + chunk_states[i]
    starts = torch.stack(starts)  # [n, H, P, N]
    if save_at:
        # a chunk's end is the next chunk's start (the padded tail writes nothing); the rest in one pass
        inside = [divmod(o - 1, chunk) for o in save_at if o != length and o % chunk]
        states = iter(_states_inside(x, b, cum, starts, inside) if inside else ())
        saved.extend(s if o == length else starts[o // chunk] if o % chunk == 0 else next(states) for o in save_at)
    starts = starts.view(n, groups, per, head_dim, size)
    y_off = torch.einsum("nlgk,ngqpk->nlgqp", c, starts).reshape(n, chunk, heads, head_dim)
    y = y + y_off * torch.exp(cum).unsqueeze(-1)
    return y.reshape(n * chunk, heads, head_dim)[:length], s


def _states_inside(x: torch.Tensor, b: torch.Tensor, cum: torch.Tensor, starts: torch.Tensor,
                   positions: list[tuple[int, int]]) -> torch.Tensor:
    """ssd_chunk_scan's states after position j of chunk i for each (i, j), batched: the chunk's start
    state decayed through j plus its writes up to j. x (times dt) [n, c, H, P], b [n, c, G, N], cum [n, c, H],
    starts [n, H, P, N] -> [len(positions), H, P, N]."""
    length = max(j for _, j in positions) + 1  # no position past the last j is read
    chunks, ends = (torch.tensor(column, device=x.device) for column in zip(*positions))
    cum_at = cum[chunks, :length]  # [m, l, H]
    upto = cum_at.gather(1, ends.view(-1, 1, 1).expand(-1, 1, cum.shape[-1]))  # [m, 1, H]: cum at j
    later = torch.arange(length, device=x.device) > ends[:, None]  # [m, l]: positions after j
    weight = (upto - cum_at).masked_fill(later.unsqueeze(-1), float("-inf")).exp()
    count, heads, head_dim = len(positions), *x.shape[2:]
    groups, size = b.shape[2:]
    xs = (x[chunks, :length] * weight.unsqueeze(-1)).view(count, length, groups, heads // groups, head_dim)
    writes = torch.einsum("mlgqp,mlgk->mgqpk", xs, b[chunks, :length]).reshape(count, heads, head_dim, size)
    return starts[chunks] * upto[:, 0].exp()[:, :, None, None] + writes


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[R, G, N] group rows -> [R, H, N]: head h reads group h // (H / G)."""
    rows, groups, size = t.shape
    return t.unsqueeze(2).expand(rows, groups, heads // groups, size).reshape(rows, heads, size)


def ssd_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of R rows: x [R, H, P], dt [R, H], a [H], b, c [R, G, N], state [R, H, P, N]
    -> (y [R, H, P] float32 without the D skip, new state float32)."""
    b, c = (_per_head(t.float(), x.shape[1]) for t in (b, c))  # [R, H, N]
    dt = dt.float()
    s = state.float() * torch.exp(dt * a.float())[..., None, None]
    s = s + (x.float() * dt.unsqueeze(-1)).unsqueeze(-1) * b.unsqueeze(2)
    return torch.einsum("rhpk,rhk->rhp", s, c), s


class GatedGroupRMSNorm(nn.Module):
    """Mamba2's norm: (y * silu(gate)) normalized per group of `group_size` channels, times the weight;
    norm_before_gate (Falcon-H1) gates the normalized, weighted y instead."""

    def __init__(self, dim: int, group_size: int, eps: float, norm_before_gate: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.group_size, self.eps, self.norm_before_gate = group_size, eps, norm_before_gate

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = y.float()
        if not self.norm_before_gate:
            h = h * F.silu(gate.float())
        groups = h.view(*h.shape[:-1], -1, self.group_size)
        h = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)).view(h.shape)
        if self.norm_before_gate:
            return (self.weight.float() * h * F.silu(gate.float())).to(self.weight.dtype)
        return self.weight * h.to(self.weight.dtype)


class Conv1dWeights(nn.Module):
    """The depthwise conv's parameters under the checkpoint's names (conv1d.weight [C, 1, W], conv1d.bias)."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None


def time_step_limit(config: dict) -> tuple[float, float]:
    """The config's (min, max) clamp on dt; transformers writes infinity as {"__float__": "Infinity"}."""
    limit = config.get("time_step_limit") or (0.0, float("inf"))
    return tuple(float(v["__float__"]) if isinstance(v, dict) else float(v) for v in limit)


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden: int, num_heads: int, head_dim: int, n_groups: int, state_size: int,
                 conv_kernel: int, chunk_size: int, eps: float, bias: bool = False, conv_bias: bool = True,
                 act: str = "silu", time_step_limit: tuple[float, float] = (0.0, float("inf")),
                 out_bias: bool | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.n_groups, self.state_size = num_heads, head_dim, n_groups, state_size
        self.intermediate = num_heads * head_dim
        self.conv_dim = self.intermediate + 2 * n_groups * state_size
        self.conv_kernel, self.chunk_size = conv_kernel, min(chunk_size, MAX_SCAN_CHUNK)
        self.in_proj = Linear(hidden, self.intermediate + self.conv_dim + num_heads, bias=bias)
        self.conv1d = Conv1dWeights(self.conv_dim, conv_kernel, conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(num_heads), requires_grad=False)
        self.norm = GatedGroupRMSNorm(self.intermediate, self.intermediate // n_groups, eps)
        self.out_proj = Linear(self.intermediate, hidden, bias=bias if out_bias is None else out_bias)
        self.act = get_activation(act)
        self.dt_min, self.dt_max = time_step_limit

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """[gate | x B C | dt] of every token (Falcon-H1 scales it)."""
        return self.in_proj(hidden)

    def recurrent_state_spec(self, ssm_dtype: torch.dtype) -> RecurrentStateSpec:
        """The conv window (its last kernel - 1 inputs) in the model dtype, the SSM state in ssm_dtype."""
        return RecurrentStateSpec(((self.conv_kernel - 1, self.conv_dim), (self.num_heads, self.head_dim, self.state_size)),
                                  (self.D.dtype, ssm_dtype), "Mamba2")

    def forward(self, hidden: torch.Tensor, state: RecurrentState, meta: RecurrentMetadata) -> torch.Tensor:
        conv_state, ssm_state = state
        gate, xbc, dt = self.project(hidden).split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        if not meta.prefill_rows and self.act is F.silu and (lib := decode_kernels(*state)) is not None:
            y = self._decode_with_kernels(lib, xbc, dt, state, meta)
            return self.out_proj(self.norm(y.view(-1, self.intermediate), gate).to(hidden.dtype))
        seats = meta.seat_ids
        weight = self.conv1d.weight.squeeze(1)
        if meta.prefill_rows:
            before = conv_state.index_select(0, seats)
            meta.store_windows(conv_state, before, xbc)
            xbc, windows = causal_conv1d(xbc, weight, self.conv1d.bias, before, meta.query_start_loc)
        else:  # decode rows only: one token per seat, no conv over a laid-out buffer
            xbc, windows = causal_conv1d_step(xbc, weight, self.conv1d.bias, conv_state.index_select(0, seats))
        conv_state.index_copy_(0, seats, windows.to(conv_state.dtype))
        xbc = self.act(xbc)
        x, b, c = xbc.split([self.intermediate, self.n_groups * self.state_size, self.n_groups * self.state_size], -1)
        x = x.view(-1, self.num_heads, self.head_dim)
        b, c = (t.view(-1, self.n_groups, self.state_size) for t in (b, c))
        dt = F.softplus(dt.float() + self.dt_bias.float())
        a = -torch.exp(self.A_log.float())
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        if meta.decode_rows:
            rows, decode_seats = meta.decode_tokens, meta.decode_seats
            out, new = ssd_step(x[rows], dt[rows], a, b[rows], c[rows], ssm_state.index_select(0, decode_seats))
            y[rows] = out
            ssm_state.index_copy_(0, decode_seats, new.to(ssm_state.dtype))
        for row in meta.prefill_rows:
            lo, hi, seat = meta.query_start_loc[row], meta.query_start_loc[row + 1], meta.seats[row]
            # time_step_limit clamps prompt steps only, as transformers' and vLLM's chunk scans do (a
            # verification row is decode steps)
            steps = dt[lo:hi] if meta.is_verification(row) else dt[lo:hi].clamp(self.dt_min, self.dt_max)
            saved: list[torch.Tensor] = []
            y[lo:hi], final = ssd_chunk_scan(x[lo:hi], steps, a, b[lo:hi], c[lo:hi], ssm_state[seat],
                                             self.chunk_size, meta.wanted.get(row, ()), saved)
            ssm_state[seat] = final.to(ssm_state.dtype)
            if saved:
                meta.store(ssm_state, row, saved)
        y = y + x.float() * self.D.float()[:, None]
        y = self.norm(y.view(-1, self.intermediate), gate)
        return self.out_proj(y.to(hidden.dtype))

    def _decode_with_kernels(self, lib: ctypes.CDLL, xbc: torch.Tensor, dt: torch.Tensor, state: RecurrentState,
                             meta: RecurrentMetadata) -> torch.Tensor:
        """A decode-only step in two C calls (conv window + SiLU, SSM step with the D skip) on the seats in place."""
        conv_state, ssm_state = state
        xbc = conv_update(lib, xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_state, meta.seat_ids,
                          silu=True)
        return mamba2_step(lib, xbc, dt, self.dt_bias, self.A_log, self.D, ssm_state, meta.seat_ids, self.n_groups)
