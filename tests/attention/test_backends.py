"""Both attention backends on the same batches against a dense float64 reference: decode rows, a
chunked prefill over cached context, a fresh prefill; full and sliding attention, GQA, soft-capping;
every cache dtype (fp8 / int8 within their formats' error of the reference, and the two backends
agreeing with each other on what the quantized cache holds).
Table entries of blocks a window has left point at a NaN-filled block: no backend may read them. And
the backend choice: by device, VLLMPY_ATTENTION_BACKEND, refusals that list the valid names."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from vllmpy.attention.backends import BACKEND_ENV, BACKENDS, select_backend
from vllmpy.attention.base import AttentionSpec
from vllmpy.attention.layer import PagedAttention
from vllmpy.engine.kv_cache_spec import FullAttentionSpec

BS, KV_HEADS, HEADS, DIM = 4, 2, 4, 16
# (cached context, new tokens) per row: decode rows around a chunked prefill and a fresh prefill.
ROWS = [(9, 1), (30, 5), (0, 6), (1, 1), (23, 1)]
# Cache dtype -> largest error against the float64 reference on N(0, 1) K/V (measured over these
# batches: float32 3e-7, e4m3 0.11, e5m2 0.21, int8 0.015; bounds with about 2x margin).
CACHE_DTYPES = {torch.float32: 1e-5, torch.float8_e4m3fn: 0.25, torch.float8_e5m2: 0.45, torch.int8: 0.04}


def stored_as(cache: torch.Tensor, dtype: torch.dtype):
    """The float cache written into a paged cache of `dtype` (fp8 over non-unit scales), every slot."""
    if dtype == torch.float32:
        return cache
    num_blocks = cache.shape[1]
    spec = FullAttentionSpec(BS, KV_HEADS, DIM, dtype)
    paged = spec.view(torch.zeros(spec.page_bytes * num_blocks, dtype=torch.uint8), num_blocks)
    paged.k_scale, paged.v_scale = 0.5, 2.0
    paged.write(cache[0].reshape(-1, KV_HEADS, DIM), cache[1].reshape(-1, KV_HEADS, DIM),
                torch.arange(num_blocks * BS))
    return paged


def reference(q, keys, values, q_start, spec: AttentionSpec) -> torch.Tensor:
    """Dense causal attention of queries at positions q_start.. over keys 0..: float64, GQA by repeat;
    a chunk size keeps each query to its own chunk, sinks join each head's softmax denominator."""
    group = spec.num_heads // spec.num_kv_heads
    k = keys.double().repeat_interleave(group, dim=1)  # [L, heads, dim]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * spec.scale
    if spec.logit_soft_cap:
        scores = torch.tanh(scores / spec.logit_soft_cap) * spec.logit_soft_cap
    q_pos = torch.arange(q_start, q_start + q.shape[0])[:, None]
    k_pos = torch.arange(keys.shape[0])[None, :]
    visible = k_pos <= q_pos
    if spec.sliding_window is not None:
        visible &= k_pos > q_pos - spec.sliding_window
    if spec.chunk_size is not None:
        visible &= k_pos // spec.chunk_size == q_pos // spec.chunk_size
    scores = scores.masked_fill(~visible, -math.inf)
    if spec.sinks is not None:
        sink = spec.sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def make_step(backend, spec: AttentionSpec, seed: int):
    """A paged cache holding each row's cached context, this step's q/k/v, the metadata, the expected output."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [cached + new for cached, new in ROWS]
    num_blocks = sum(-(-n // BS) for n in lengths) + 1
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0: the NaN block placeholders point at
    cache = torch.randn(2, num_blocks, BS, KV_HEADS, DIM, generator=gen)
    cache[:, 0] = float("nan")
    truth_k = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in lengths]
    truth_v = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in lengths]
    tables, slots, q, k, v, expected, used = [], [], [], [], [], [], 0
    query_start_loc, decode_rows, prefill_rows = [0], [], []
    for row, ((cached, new), n) in enumerate(zip(ROWS, lengths)):
        table = ids[used:used + -(-n // BS)].tolist()
        used += len(table)
        for pos in range(cached):
            cache[0, table[pos // BS], pos % BS] = truth_k[row][pos]
            cache[1, table[pos // BS], pos % BS] = truth_v[row][pos]
        if spec.sliding_window is not None:  # blocks no query of this step can see: back in the pool
            first_visible = max(0, cached - spec.sliding_window + 1) // BS
            table[:first_visible] = [0] * first_visible
        tables.append(table)
        slots += [table[pos // BS] * BS + pos % BS for pos in range(cached, n)]
        rq = torch.randn(new, HEADS, DIM, generator=gen)
        q.append(rq)
        k.append(truth_k[row][cached:])
        v.append(truth_v[row][cached:])
        expected.append(reference(rq, truth_k[row], truth_v[row], cached, spec))
        query_start_loc.append(query_start_loc[-1] + new)
        (decode_rows if new == 1 else prefill_rows).append(row)
    width = max(len(t) for t in tables)
    meta = backend.build_metadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        query_start_loc=query_start_loc, seq_lens=lengths, block_size=BS, decode_rows=decode_rows,
        prefill_rows=prefill_rows)
    return cache, torch.cat(q), torch.cat(k), torch.cat(v), meta, torch.cat(expected)


@pytest.mark.parametrize("dtype", list(CACHE_DTYPES), ids=["f32", "e4m3", "e5m2", "int8"])
@pytest.mark.parametrize("cap", [None, 5.0], ids=["nocap", "cap"])
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
def test_backends_match_dense_reference(window, cap, dtype):
    spec = AttentionSpec(HEADS, KV_HEADS, DIM, scale=DIM ** -0.5, sliding_window=window, logit_soft_cap=cap)
    outs = {}
    for name, backend in BACKENDS.items():
        cache, q, k, v, meta, expected = make_step(backend(), spec, seed=window or 0)  # the same batch
        outs[name] = PagedAttention(spec)(q, k, v, stored_as(cache, dtype), meta)
        assert outs[name].isfinite().all(), f"{name} read a block outside the window"
        torch.testing.assert_close(outs[name].double(), expected, atol=CACHE_DTYPES[dtype], rtol=0, msg=name)
    torch.testing.assert_close(outs["cpu"], outs["torch"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["sinks", "sinks-window7", "chunk8"])
def test_sinks_and_chunked_attention_match_dense_reference(case):
    """gpt-oss's sinks (alone and on a sliding layer) and Llama 4's chunked local attention, on both
    backends: decode rows (the CPU backend's C kernel), a chunked prefill over cached context, a fresh one."""
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(7)) * 2
    spec = AttentionSpec(HEADS, KV_HEADS, DIM, scale=DIM ** -0.5, sliding_window=7 if "window" in case else None,
                         chunk_size=8 if case == "chunk8" else None, sinks=sinks if "sinks" in case else None)
    for name, backend in BACKENDS.items():
        cache, q, k, v, meta, expected = make_step(backend(), spec, seed=3)
        layer = PagedAttention(replace(spec, sinks=None), sinks=spec.sinks is not None)
        if layer.sinks is not None:
            layer.sinks.data.copy_(sinks)
        out = layer(q, k, v, cache, meta)
        assert out.isfinite().all(), f"{name} read a block outside the window"
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0, msg=name)


def test_default_backend_per_device_and_the_override(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert select_backend(torch.device("cpu")).name == "cpu"  # the C kernel builds on every test machine
    assert select_backend(torch.device("meta")).name == "torch"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert select_backend(torch.device("cpu")).name == "torch"
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with pytest.raises(ValueError, match="'flash' is not an attention backend; choose one of cpu, torch"):
        select_backend(torch.device("cpu"))
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    with pytest.raises(ValueError, match="CPU only"):
        select_backend(torch.device("meta"))
