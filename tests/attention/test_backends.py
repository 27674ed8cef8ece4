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

from vllmpy.attention import torch_paged
from vllmpy.attention.backends import BACKEND_ENV, BACKENDS, select_backend
from vllmpy.attention.base import AttentionSpec, GroupInputs, PrefillSeq, StepLayout
from vllmpy.attention.layer import PagedAttention
from vllmpy.engine.kv_cache_spec import FullAttentionSpec
from tests.attention.step_metadata import one_group

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


def make_step(backend, spec: AttentionSpec, seed: int, rows=ROWS, num_draft_tokens=None):
    """A paged cache holding each row's cached context, this step's q/k/v, the metadata, the expected output."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [cached + new for cached, new in rows]
    num_blocks = sum(-(-n // BS) for n in lengths) + 1
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0: the NaN block placeholders point at
    cache = torch.randn(2, num_blocks, BS, KV_HEADS, DIM, generator=gen)
    cache[:, 0] = float("nan")
    truth_k = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in lengths]
    truth_v = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in lengths]
    tables, slots, q, k, v, expected, used = [], [], [], [], [], [], 0
    for row, ((cached, new), n) in enumerate(zip(rows, lengths)):
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
    width = max(len(t) for t in tables)
    meta = one_group(backend, rows, torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.tensor(slots),
                     BS, num_draft_tokens, views=[spec.decode_view])
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


@pytest.mark.parametrize("name", list(BACKENDS))
def test_metadata_tensors_match_the_layout(name):
    """build_metadata turns the step layout into int64 tensors once, shared by every group's metadata: the
    decode tokens (one-token rows over a context and a verification's tokens) with each group's own tables,
    the prefill rows (a one-token prompt is one) as tensors and as the host copy the loop slices by."""
    rows = [(9, 1), (30, 5), (0, 1), (6, 3), (23, 1)]  # row 3 verifies 2 drafts
    starts, lens = [0, 1, 6, 7, 10, 11], [10, 35, 1, 9, 24]
    tables = [torch.arange(50).view(5, 10), torch.arange(50, 100).view(5, 10)]
    layout = StepLayout(starts, lens, [0, 0, 0, 2, 0], BS, bidirectional_spans=[[], [(31, 33)], [], [], []])
    metas = BACKENDS[name]().build_metadata(
        layout, [GroupInputs(torch.arange(11), t, frozenset({(None, None)})) for t in tables])
    for meta, table in zip(metas, tables):
        assert meta.query_start_loc.tolist() == starts and meta.seq_lens.tolist() == lens
        assert meta.query_start_loc.dtype == meta.seq_lens.dtype == torch.int64
        assert meta.decode.token_idx.tolist() == [0, 7, 8, 9, 10] and meta.decode.rows.tolist() == [0, 1, 2, 3, 4]
        assert meta.decode.seq_lens.tolist() == [10, 7, 8, 9, 24]
        assert torch.equal(meta.decode.tables, table[[0, 3, 3, 3, 4]])
        prefill = meta.prefill
        assert (prefill.rows.tolist(), prefill.query_start.tolist(), prefill.query_lens.tolist(),
                prefill.context_lens.tolist()) == ([1, 2], [1, 6], [5, 1], [30, 0])
        assert prefill.seqs == (PrefillSeq(1, 1, 6, 35, [(31, 33)]), PrefillSeq(2, 6, 7, 1, []))
        assert meta.block_size == BS and meta.backend is metas[0].backend
    assert metas[0].query_start_loc is metas[1].query_start_loc and metas[0].prefill is metas[1].prefill
    assert metas[0].decode.token_idx is metas[1].decode.token_idx  # built once for every group
    (meta,) = BACKENDS[name]().build_metadata(StepLayout([0, 1, 2], [10, 4], [0, 0], BS), [GroupInputs(
        torch.arange(2), tables[0][:2])])  # every row decodes one token: the group's table is theirs
    assert meta.prefill is None and meta.decode.token_idx.tolist() == meta.decode.rows.tolist() == [0, 1]
    assert meta.decode.seq_lens.tolist() == [10, 4] and torch.equal(meta.decode.tables, tables[0][:2])


def test_torch_backend_indexes_decode_views_when_it_builds(monkeypatch):
    """The torch backend builds each declared view's decode index with the metadata, so no layer builds one;
    the CPU backend (its C kernel reads the tables) builds none."""
    spec = AttentionSpec(HEADS, KV_HEADS, DIM, scale=DIM ** -0.5, sliding_window=7)
    cache, q, k, v, meta, expected = make_step(BACKENDS["torch"](), spec, seed=5)
    assert set(meta.decode_index) == {(7, None)}
    assert make_step(BACKENDS["cpu"](), spec, seed=5)[4].decode_index == {}
    monkeypatch.setattr(torch_paged, "decode_index", lambda *args: pytest.fail("a layer built a decode index"))
    out = PagedAttention(spec)(q, k, v, cache, meta)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
