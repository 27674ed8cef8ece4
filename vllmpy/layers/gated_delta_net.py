"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the gated delta rule, its causal conv1d and gated RMSNorm.

Each value head keeps a [k_dim, v_dim] matrix S. Per token: S <- exp(g) S, then the delta rule writes
v at key k with strength beta (S <- S + k (beta (v - S^T k))^T), and the output reads S^T q. Decode
rows run that step batched; a prefill runs the chunked (WY) form, whose within-chunk work is matmuls and
one triangular solve, with a Python loop only over chunks (transformers' `torch_chunk_gated_delta_rule`
is the reference). Both keep S in float32 (or the --mamba-ssm-cache-dtype seat dtype between steps).
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.linear import Linear, MergedLinear
from vllmpy.layers.recurrent_kernels import conv_update, decode_kernels
from vllmpy.layers.recurrent_kernels import gated_delta_step as gated_delta_step_kernel
from vllmpy.layers.recurrent_state import RecurrentMetadata, RecurrentState, RecurrentStateSpec

CHUNK = 64  # transformers' and FLA's chunk size


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's l2norm, which the checkpoints were trained with)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, chunk: int = CHUNK, save_at: Sequence[int] = (),
                           saved: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's prefill. q, k [T, H, Dk] (normalized and scaled), v [T, H, Dv], g (log decay <= 0) and
    beta [T, H], state [H, Dk, Dv] float32 -> (out [T, H, Dv] float32, final state [H, Dk, Dv]). For each
    o in `save_at` (1..T) the state after the first o tokens is appended to `saved` (snapshots, verification).

    Within a chunk with cumulative decay G_i, the writes u_i = beta_i (v_i - exp(G_i) S0^T k_i -
    sum_{j<i} exp(G_i - G_j) (k_j . k_i) u_j) are a unit lower-triangular system, solved for all chunks
    at once; the state then passes chunk to chunk. The tail is padded with k = v = beta = g = 0, which
    writes nothing and decays nothing.
    """
    length, heads, _ = k.shape
    chunk = min(chunk, length)  # a short prefill is one chunk of its own length, not padded to 64
    pad = -length % chunk
    q, k, v, g, beta = (_pad_time(x.float(), pad) for x in (q, k, v, g, beta))
    n = (length + pad) // chunk  # below: [H, N, C, *], heads first, then chunks
    q, k, v = (x.transpose(0, 1).reshape(heads, n, chunk, -1) for x in (q, k, v))
    g, beta = (x.transpose(0, 1).reshape(heads, n, chunk) for x in (g, beta))
    cum = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # exp(G_i - G_j), j <= i
    k_beta = k * beta.unsqueeze(-1)
    # I + A, A_ij = beta_i exp(G_i - G_j) (k_i . k_j) for j < i (the diagonal is taken as 1)
    system = k_beta @ k.transpose(-1, -2) * decay
    solve = torch.linalg.solve_triangular
    writes = solve(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)  # u for S0 = 0
    from_state = solve(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    scores = q @ k.transpose(-1, -2) * decay  # (q_i . k_j) exp(G_i - G_j), j <= i
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(writes)
    s = state.float()
    ends: dict[int, list[int]] = {}  # chunk -> offsets in it after which the state is saved
    for offset in save_at:
        ends.setdefault((offset - 1) // chunk, []).append(offset)
    for i in range(n):
        u = writes[:, i] - from_state[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + scores[:, i] @ u
        start = s
        s = s * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ u
        for offset in ends.get(i, ()):  # the chunk's start state decayed through j, plus its first j + 1 writes
            j = (offset - 1) % chunk
            if offset == length or j == chunk - 1:  # the chunk's end (the padded tail writes nothing)
                saved.append(s)
                continue
            to_j = k[:, i, :j + 1] * (cum[:, i, j:j + 1] - cum[:, i, :j + 1]).exp().unsqueeze(-1)
            saved.append(start * cum[:, i, j].exp()[:, None, None] + to_j.transpose(-1, -2) @ u[:, :j + 1])
    out = out.reshape(heads, n * chunk, -1)[:, :length].transpose(0, 1)
    return out, s


def _pad_time(x: torch.Tensor, pad: int) -> torch.Tensor:
    """Zero rows appended along dim 0 (time)."""
    if pad == 0:
        return x
    return torch.cat((x, x.new_zeros(pad, *x.shape[1:])))


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B decode rows: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state
    [B, H, Dk, Dv] float32 (updated in place) -> (out [B, H, Dv] float32, the new state).

    Both reads come from the old state in one matmul (S^T k and S^T q, with the decay e = exp(g) applied
    after): delta = beta (v - e S^T k), out = e S^T q + (q . k) delta, then S <- e S + k delta^T. The
    state is the memory-bound part, so it is read by one matmul and rewritten by two in-place passes.
    """
    batch, heads, k_dim = k.shape
    q, k, decay = q.float(), k.float(), g.float().exp().unsqueeze(-1)
    s = state.view(batch * heads, k_dim, -1)
    reads = torch.bmm(torch.stack((k, q), dim=2).view(batch * heads, 2, k_dim), s).view(batch, heads, 2, -1)
    delta = (v.float() - decay * reads[:, :, 0]) * beta.float().unsqueeze(-1)
    out = decay * reads[:, :, 1] + (q * k).sum(-1, keepdim=True) * delta
    s.mul_(decay.view(batch * heads, 1, 1)).baddbmm_(k.reshape(batch * heads, k_dim, 1),
                                                     delta.reshape(batch * heads, 1, -1))
    return out, state


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor,
                  query_start_loc: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over a flat batch of sequences, each continuing from its state.

    x [T, C] (sequence s owns rows query_start_loc[s]:query_start_loc[s + 1]), weight [C, W], states
    [S, W - 1, C] (each sequence's last W - 1 inputs before these rows; zeros for a fresh one) ->
    (out [T, C], new states [S, W - 1, C]). Each sequence is laid out after its state in one buffer
    and a single conv1d runs over all of them; the W - 1 outputs that straddle two sequences are dropped.
    """
    keep, channels = weight.shape[1] - 1, x.shape[1]
    token_at, state_at, tail_at = _conv_layout(query_start_loc, keep, x.device)
    buf = x.new_empty(x.shape[0] + states.shape[0] * keep, channels)
    buf[token_at] = x
    buf[state_at.reshape(-1)] = states.reshape(-1, channels).to(x.dtype)
    out = F.conv1d(buf.t().unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), bias, groups=channels)[0].t()
    return out[token_at - keep].to(x.dtype), buf[tail_at.reshape(-1)].reshape(states.shape)


def _conv_layout(query_start_loc: list[int], keep: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Buffer rows of each token [T], of each sequence's state [S, keep] and of its last `keep` rows
    [S, keep]: sequence s's state comes just before its tokens, which shift down by keep * (s + 1)."""
    starts = torch.tensor(query_start_loc, dtype=torch.int64, device=device)
    lengths = starts[1:] - starts[:-1]
    seq = torch.arange(len(lengths), device=device)
    token_at = torch.arange(query_start_loc[-1], device=device) + keep * (torch.repeat_interleave(seq, lengths) + 1)
    offsets = torch.arange(keep, device=device)
    state_at = (starts[:-1] + keep * seq).unsqueeze(1) + offsets
    tail_at = (starts[1:] + keep * seq).unsqueeze(1) + offsets  # one past the last token, minus keep
    return token_at, state_at, tail_at


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input per sequence: x [B, C], states [B, W - 1, C] -> (out [B, C], new states)."""
    window = torch.cat((states.to(x.dtype), x.unsqueeze(1)), dim=1)  # [B, W, C]
    out = torch.einsum("bwc,cw->bc", window.to(weight.dtype), weight)
    if bias is not None:
        out = out + bias
    return out.to(x.dtype), window[:, 1:]


def _seat_run(seats: list[int]) -> tuple[int, int]:
    """(first seat, count) when the seats are consecutive and ascending, else (0, 0)."""
    first = seats[0]
    return (first, len(seats)) if seats == list(range(first, first + len(seats))) else (0, 0)


class RMSNormGated(nn.Module):
    """norm(x) * weight * silu(gate) per value head (its weight starts at 1, not zero-centred)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention mixer: in_proj -> causal conv (SiLU) -> gated delta rule -> gated norm -> out.

    One fused projection gives [q | k | v] (the conv's channels), the output gate z and the per-value-head
    b (write strength, beta = sigmoid(b)) and a (decay, g = -exp(A_log) softplus(a + dt_bias)). Value
    heads may outnumber key heads (each key head serves num_v_heads / num_k_heads of them). Per seat it
    keeps the conv window [kernel - 1, conv_dim] (model dtype) and S [num_v_heads, k_dim, v_dim] (ssm dtype).
    """

    def __init__(self, config: dict, eps: float) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
        self.k_dim, self.v_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
        if self.num_v_heads % self.num_k_heads:
            raise UnsupportedCheckpointError(
                f"config linear_num_value_heads={self.num_v_heads} must be a multiple of "
                f"linear_num_key_heads={self.num_k_heads}")
        self.key_dim, self.value_dim = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kernel = config.get("linear_conv_kernel_dim", 4)
        if kernel < 2:
            raise UnsupportedCheckpointError(f"config linear_conv_kernel_dim={kernel} must be >= 2")
        hidden = config["hidden_size"]
        self.make_projections(hidden)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.norm = RMSNormGated(self.v_dim, eps)
        self.out_proj = Linear(self.value_dim, hidden)

    def make_projections(self, hidden: int) -> None:
        """Qwen3.5's four projections (in_proj_qkv, _z, _b, _a), fused into one matmul."""
        self.in_proj = MergedLinear(hidden, {"qkv": self.conv_dim, "z": self.value_dim, "b": self.num_v_heads,
                                             "a": self.num_v_heads})

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (the conv input [T, conv_dim], z [T, value_dim], b [T, Hv], a [T, Hv])."""
        qkv, z, b, a = self.in_proj.split(self.in_proj(x))
        return qkv, z, b, a

    def recurrent_state_spec(self, ssm_dtype: torch.dtype) -> RecurrentStateSpec:
        kernel = self.conv1d.weight.shape[-1]
        return RecurrentStateSpec(((kernel - 1, self.conv_dim), (self.num_v_heads, self.k_dim, self.v_dim)),
                                  (self.conv1d.weight.dtype, ssm_dtype), label="GDN")

    def forward(self, x: torch.Tensor, state: RecurrentState, meta: RecurrentMetadata) -> torch.Tensor:
        conv_states, ssm_states = state
        mixed, z, b, a = self.project(x)
        if not meta.prefill_rows and (lib := decode_kernels(*state)) is not None:
            return self._output(self._decode_with_kernels(lib, mixed, a, b, state, meta), z, x.dtype)
        mixed = F.silu(self._conv(mixed, conv_states, meta))
        tokens = x.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        repeat = self.num_v_heads // self.num_k_heads
        q = l2_normalize(q.reshape(tokens, self.num_k_heads, self.k_dim).float()) * self.k_dim ** -0.5
        k = l2_normalize(k.reshape(tokens, self.num_k_heads, self.k_dim).float())
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        v = v.reshape(tokens, self.num_v_heads, self.v_dim)
        beta = torch.sigmoid(b).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return self._output(self._delta_rule(q, k, v, g, beta, ssm_states, meta), z, x.dtype)

    def _output(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The delta rule's output [T, Hv, Dv] float32 through the gated norm and out_proj."""
        out = self.norm(out.to(dtype).reshape(-1, self.v_dim), z.reshape(-1, self.v_dim))
        return self.out_proj(out.reshape(-1, self.value_dim))

    def _decode_with_kernels(self, lib: ctypes.CDLL, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                             state: RecurrentState, meta: RecurrentMetadata) -> torch.Tensor:
        """A decode-only step in two C calls (conv window + SiLU; l2 norms, gates and the delta rule) on the
        seats in place -> out [B, Hv, Dv] float32."""
        conv_states, ssm_states = state
        mixed = conv_update(lib, mixed, self.conv1d.weight[:, 0], None, conv_states, meta.seat_ids, silu=True)
        return gated_delta_step_kernel(lib, mixed, a, b, self.A_log, self.dt_bias, ssm_states, meta.seat_ids,
                                       self.num_k_heads, self.k_dim)

    def _conv(self, mixed: torch.Tensor, conv_states: torch.Tensor, meta: RecurrentMetadata) -> torch.Tensor:
        weight = self.conv1d.weight[:, 0]
        if not meta.prefill_rows:  # every chunk is one token: the step update
            out, new = causal_conv1d_step(mixed, weight, None, conv_states.index_select(0, meta.seat_ids))
        else:
            before = conv_states.index_select(0, meta.seat_ids)
            meta.store_windows(conv_states, before, mixed)
            out, new = causal_conv1d(mixed, weight, None, before, meta.query_start_loc)
        conv_states.index_copy_(0, meta.seat_ids, new.to(conv_states.dtype))
        return out

    @staticmethod
    def _delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    ssm_states: torch.Tensor, meta: RecurrentMetadata) -> torch.Tensor:
        """Decode rows in one batched step, each prefill chunk through the chunked rule; seats updated."""
        out = torch.empty(*v.shape, dtype=torch.float32, device=v.device)
        if meta.decode_rows:
            rows, seats = meta.decode_tokens, meta.decode_seats
            first, run = _seat_run([meta.seats[r] for r in meta.decode_rows])
            if run and ssm_states.dtype == torch.float32:  # consecutive seats: updated in place, no gather
                out[rows] = gated_delta_step(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                             ssm_states[first:first + run])[0]
            else:
                o, s = gated_delta_step(q[rows], k[rows], v[rows], g[rows], beta[rows], ssm_states[seats].float())
                out[rows] = o
                ssm_states.index_copy_(0, seats, s.to(ssm_states.dtype))
        for row in meta.prefill_rows:
            lo, hi, seat = meta.query_start_loc[row], meta.query_start_loc[row + 1], meta.seats[row]
            saved: list[torch.Tensor] = []
            o, s = chunk_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], ssm_states[seat],
                                          save_at=meta.wanted.get(row, ()), saved=saved)
            out[lo:hi] = o
            ssm_states[seat] = s.to(ssm_states.dtype)
            if saved:
                meta.store(ssm_states, row, saved)
        return out
