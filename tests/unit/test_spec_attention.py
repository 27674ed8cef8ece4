"""A speculative verification chunk (the last token and its drafts at the end of a cached context) is
attended in the backends' batched decode call, one decode per query token, not the per-sequence prefill
loop, and matches the dense reference on both backends (full and sliding attention, float and int8 cache)."""
from __future__ import annotations

import pytest
import torch

from tests.attention.test_backends import CACHE_DTYPES, DIM, HEADS, KV_HEADS, ROWS, make_step, stored_as
from vllmpy.attention import torch_paged
from vllmpy.attention.backends import BACKENDS
from vllmpy.attention.base import AttentionSpec
from vllmpy.attention.layer import PagedAttention


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=["f32", "int8"])
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
def test_verification_rows_decode_in_the_batched_call(window, dtype, monkeypatch):
    spec = AttentionSpec(HEADS, KV_HEADS, DIM, scale=DIM ** -0.5, sliding_window=window)
    verifying = [row for row, (cached, new) in enumerate(ROWS) if cached and new > 1]
    assert verifying, "ROWS has no multi-token row over cached context"
    gathers = []
    original = torch_paged._gather_seq
    monkeypatch.setattr(torch_paged, "_gather_seq", lambda *a: gathers.append(a[2]) or original(*a))
    drafts = [new - 1 if row in verifying else 0 for row, (_, new) in enumerate(ROWS)]
    decode = [row for row, (cached, new) in enumerate(ROWS) if cached and (new == 1 or row in verifying)]
    for name, backend in BACKENDS.items():
        cache, q, k, v, meta, expected = make_step(backend(), spec, seed=11, num_draft_tokens=drafts)
        assert meta.decode.token_idx.numel() == sum(ROWS[r][1] for r in decode)
        assert {seq.row for seq in meta.prefill.seqs}.isdisjoint(decode)
        out = PagedAttention(spec)(q, k, v, stored_as(cache, dtype), meta)
        assert out.isfinite().all(), f"{name} read a block outside the window"
        torch.testing.assert_close(out.double(), expected, atol=CACHE_DTYPES[dtype], rtol=0, msg=name)
        assert not set(gathers) & set(verifying), f"{name} attended a verification row sequence by sequence"
