"""The Gated DeltaNet math: the chunked delta rule against the token-by-token recurrence (every split
of a prefill, the state carried), the batched decode step against transformers' reference, the
varlen causal conv1d and its one-step update against a full convolution, and the gated norm."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from vllmpy.layers.gated_delta_net import (
    RMSNormGated,
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    gated_delta_step,
    l2_normalize,
)

HEADS, K_DIM, V_DIM = 3, 8, 12


def _inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(length, HEADS, K_DIM, generator=gen)) * K_DIM ** -0.5
    k = l2_normalize(torch.randn(length, HEADS, K_DIM, generator=gen))
    v = torch.randn(length, HEADS, V_DIM, generator=gen)
    g = -torch.rand(length, HEADS, generator=gen) * 4  # down to exp(-4) per token: decays that matter
    beta = torch.rand(length, HEADS, generator=gen)
    state = torch.randn(HEADS, K_DIM, V_DIM, generator=gen) * 0.5
    return q, k, v, g, beta, state


def _recurrence(q, k, v, g, beta, state):
    """The definition, one token at a time."""
    s, out = state.clone(), []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(out), s


@pytest.mark.parametrize("chunk", [4, 64])
def test_chunked_rule_equals_recurrence_for_every_split(chunk):
    """A 23-token prefill split at every position (each piece continuing the other's state) gives the
    recurrence's outputs and final state; with chunk 4 the split lands at every offset within a chunk."""
    length = 23
    q, k, v, g, beta, state = _inputs(length)
    want_out, want_state = _recurrence(q, k, v, g, beta, state)
    for split in range(length + 1):
        outs, s = [], state
        for lo, hi in ((0, split), (split, length)):
            if hi > lo:
                out, s = chunk_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], s, chunk)
                outs.append(out)
        assert torch.allclose(torch.cat(outs), want_out, atol=1e-5), f"split at {split}"
        assert torch.allclose(s, want_state, atol=1e-5), f"split at {split}"


def test_chunked_rule_over_three_pieces_and_many_chunks():
    q, k, v, g, beta, state = _inputs(150, seed=1)
    want_out, want_state = _recurrence(q, k, v, g, beta, state)
    outs, s = [], state
    for lo, hi in ((0, 37), (37, 101), (101, 150)):
        out, s = chunk_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], s, 16)
        outs.append(out)
    assert torch.allclose(torch.cat(outs), want_out, atol=1e-5)
    assert torch.allclose(s, want_state, atol=1e-5)


def test_decode_step_matches_transformers_recurrent_rule():
    """The batched step (value heads outnumbering key heads, transformers' l2norm and scaling) is
    transformers' torch_recurrent_gated_delta_rule, token after token, for 5 sequences at once."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    torch.manual_seed(0)
    batch, steps, k_heads, v_heads = 5, 6, 2, 4
    q, k = torch.randn(batch, steps, k_heads, K_DIM), torch.randn(batch, steps, k_heads, K_DIM)
    v = torch.randn(batch, steps, v_heads, V_DIM)
    g, beta = -torch.rand(batch, steps, v_heads) * 2, torch.rand(batch, steps, v_heads)
    state = torch.randn(batch, v_heads, K_DIM, V_DIM)
    want, want_state = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn = (l2_normalize(q) * K_DIM ** -0.5).repeat_interleave(2, dim=2)
    kn = l2_normalize(k).repeat_interleave(2, dim=2)
    s, outs = state, []
    for t in range(steps):
        out, s = gated_delta_step(qn[:, t], kn[:, t], v[:, t], g[:, t], beta[:, t], s)
        outs.append(out)
    assert torch.allclose(torch.stack(outs, dim=1), want, atol=1e-5)
    assert torch.allclose(s, want_state, atol=1e-5)


def _full_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv of one whole sequence [L, C] from zeros."""
    width = weight.shape[1]
    return F.conv1d(x.t()[None], weight[:, None], bias, padding=width - 1, groups=x.shape[1])[0].t()[:x.shape[0]]


def test_conv_prefill_in_pieces_and_steps_equals_full_conv():
    """Four sequences (one shorter than the window) prefilled together in two varlen steps, then
    decoded one token per step, give the full convolution; each state is its last kernel - 1 inputs."""
    torch.manual_seed(0)
    channels, width = 6, 4
    weight, bias = torch.randn(channels, width), torch.randn(channels)
    seqs = [torch.randn(n, channels) for n in (9, 2, 14, 5)]
    pieces = [(0, 4), (4, 7)]  # prefill rows [0, 4), then [4, 7); the rest decode one at a time
    states = torch.zeros(len(seqs), width - 1, channels)
    got = [[] for _ in seqs]
    for lo, hi in pieces:
        parts = [s[lo:min(hi, len(s))] for s in seqs]
        live = [i for i, p in enumerate(parts) if len(p)]
        starts = [0]
        for i in live:
            starts.append(starts[-1] + len(parts[i]))
        out, new = causal_conv1d(torch.cat([parts[i] for i in live]), weight, bias, states[live], starts)
        states[live] = new
        for j, i in enumerate(live):
            got[i].append(out[starts[j]:starts[j + 1]])
    for t in range(7, max(len(s) for s in seqs)):
        live = [i for i, s in enumerate(seqs) if t < len(s)]
        out, new = causal_conv1d_step(torch.stack([seqs[i][t] for i in live]), weight, bias, states[live])
        states[live] = new
        for j, i in enumerate(live):
            got[i].append(out[j:j + 1])
    for i, s in enumerate(seqs):
        assert torch.allclose(torch.cat(got[i]), _full_conv(s, weight, bias), atol=1e-6), f"sequence {i}"
        tail = torch.cat((torch.zeros(width - 1, channels), s))[-(width - 1):]
        assert torch.equal(states[i], tail), f"sequence {i}'s state"


def test_gated_norm_matches_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    torch.manual_seed(0)
    ref = Qwen3NextRMSNormGated(V_DIM, eps=1e-6)
    ref.weight.data.normal_(1.0, 0.3)
    ours = RMSNormGated(V_DIM, eps=1e-6)
    ours.weight.data.copy_(ref.weight.data)
    x, gate = torch.randn(10, V_DIM), torch.randn(10, V_DIM)
    assert torch.allclose(ours(x, gate), ref(x, gate), atol=1e-6)
