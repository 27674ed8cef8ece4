"""The C paged decode kernel (vllmpy/kernels/paged_attention.c) against the torch decode path: shuffled
block tables, ragged contexts (2 tokens: the shortest decode; exact block boundaries; longer than the
window), GQA groups, head sizes, sliding windows, soft-capping, fp32/bf16/f16 caches, split positions
across threads; and
paged_attention on CPU taking the kernel, or the torch path when the kernel is unavailable."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from vllmpy import kernels
from vllmpy.attention import torch_paged
from vllmpy.attention.backends import CPUAttentionBackend
from vllmpy.attention.base import AttentionMetadata, AttentionSpec
from vllmpy.attention.kv_storage import as_paged
from vllmpy.attention.torch_paged import decode_index, paged_attention
from tests.attention.step_metadata import one_group

ATOL_F32 = 1e-5  # same fp32 inputs: only summation order and exp/tanh rounding differ
PREFILL_LEN = 3  # query tokens of the prefill rows interleaved with the decode rows
WINDOW = 40
SOFT_CAP = 5.0  # small enough that tanh really bends the scores of N(0, 1) data


@pytest.fixture(scope="module")
def lib():
    found = kernels.attention_kernels()
    if found is None:
        pytest.fail("the paged-attention kernel did not build on this machine (a C compiler is part of the setup)")
    return found


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_batch(seq_lens: list[int], block_size: int, kv_heads: int, dim: int, dtype: torch.dtype,
               seed: int, prefill_between: bool = True) -> tuple[torch.Tensor, AttentionMetadata]:
    """A random cache and metadata whose decode rows own shuffled, non-contiguous blocks; a prefill row
    between decode rows (when asked) so decode tokens are not rows 0..B-1 of q."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = 2 * sum(needed) + 3  # spare blocks: ids are sparse as well as shuffled
    ids = torch.randperm(num_blocks, generator=gen)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    rows, tables = [], []  # (cached, new) per row and its blocks
    used = 0
    for i, n in enumerate(seq_lens):
        if prefill_between and i % 2 == 1:  # its blocks are never read here; tokens only shift the rows
            rows.append((n - PREFILL_LEN, PREFILL_LEN))
            tables.append(ids[used:used + needed[i]])
        rows.append((n - 1, 1))
        tables.append(ids[used:used + needed[i]])
        used += needed[i]
    table = torch.zeros(len(rows), max(needed) + 2, dtype=torch.int64)  # padded past every row's blocks
    for r, blocks in enumerate(tables):
        table[r, :len(blocks)] = blocks
    return cache, one_group(CPUAttentionBackend(), rows, table, torch.empty(0, dtype=torch.int64), block_size)


def spec_for(heads: int, kv_heads: int, dim: int, window: int | None, cap: float | None) -> AttentionSpec:
    return AttentionSpec(heads, kv_heads, dim, scale=dim ** -0.5, sliding_window=window, logit_soft_cap=cap)


def both_paths(lib, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kernel output of every token, torch decode rows computed in float32, decode token indices)."""
    tokens = meta.decode.token_idx
    expected = torch_paged._decode(q[tokens].float(), as_paged(cache), torch_index(meta, spec), spec)
    out = torch.full_like(q, float("nan"))
    torch_paged._kernel_decode(lib, q, as_paged(cache), meta.decode, spec, out, tokens)
    return out, expected, tokens


def torch_index(meta: AttentionMetadata, spec: AttentionSpec):
    return decode_index(meta.decode, meta.block_size, spec.decode_view)


# 2 tokens (the shortest decode: one cached), block boundaries (16, 32, 48), window +- 1 (41, 40 + 1)
SEQ_LENS = [2, 16, 37, 32, 150, 17, 48, 41]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cap", [None, SOFT_CAP], ids=["nocap", "cap"])
@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "window"])
@pytest.mark.parametrize("dim", [64, 256])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 2)], ids=["g1", "g2", "g4"])
def test_kernel_matches_torch_decode(lib, heads, kv_heads, dim, window, cap, dtype):
    cache, meta = make_batch(SEQ_LENS, 16, kv_heads, dim, dtype, seed=heads * dim + kv_heads)
    spec = spec_for(heads, kv_heads, dim, window, cap)
    q = torch.randn(int(meta.query_start_loc[-1]), heads, dim, generator=torch.Generator().manual_seed(1))
    out, expected, tokens = both_paths(lib, q, cache, meta, spec)
    torch.testing.assert_close(out[tokens], expected, atol=ATOL_F32, rtol=0)
    untouched = torch.ones(len(q), dtype=torch.bool)
    untouched[tokens] = False
    assert out[untouched].isnan().all(), "the kernel wrote rows that are not decode rows"


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("seq_lens", [[2], [700], [33, 700, 5]], ids=["two-tokens", "batch1-long", "batch3"])
def test_positions_split_across_threads(lib, threads, seq_lens):
    """Fewer (row, KV head) pairs than threads: ranges of positions per thread, merged afterwards."""
    cache, meta = make_batch(seq_lens, 8, 1, 64, torch.float32, seed=threads, prefill_between=False)
    spec = spec_for(4, 1, 64, None, None)
    q = torch.randn(int(meta.query_start_loc[-1]), 4, 64, generator=torch.Generator().manual_seed(2))
    with num_threads(threads):
        out, expected, tokens = both_paths(lib, q, cache, meta, spec)
    torch.testing.assert_close(out[tokens], expected, atol=ATOL_F32, rtol=0)


@pytest.mark.parametrize("dim", [128, 72, 36])  # 72, 36: tails after the 16-lane and 8-wide loops
def test_f16_cache_and_odd_head_sizes(lib, dim):
    cache, meta = make_batch(SEQ_LENS, 16, 2, dim, torch.float16, seed=5)
    spec = spec_for(4, 2, dim, WINDOW, None)
    q = torch.randn(int(meta.query_start_loc[-1]), 4, dim, generator=torch.Generator().manual_seed(3))
    out, expected, tokens = both_paths(lib, q, cache, meta, spec)
    torch.testing.assert_close(out[tokens], expected, atol=ATOL_F32, rtol=0)


@pytest.mark.parametrize("qkv_layout", ["contiguous", "strided"])
def test_bf16_model_and_strided_queries(lib, qkv_layout):
    """A bf16 model (decode rows cast to fp32 and back) and fp32 q sliced out of a fused qkv output."""
    cache, meta = make_batch(SEQ_LENS, 16, 2, 64, torch.bfloat16, seed=7)
    spec = spec_for(4, 2, 64, None, SOFT_CAP)
    fused = torch.randn(int(meta.query_start_loc[-1]), 8 * 64, generator=torch.Generator().manual_seed(4))
    q = fused[:, :4 * 64].view(-1, 4, 64) if qkv_layout == "strided" else fused[:, :4 * 64].reshape(-1, 4, 64)
    out, expected, tokens = both_paths(lib, q, cache, meta, spec)
    torch.testing.assert_close(out[tokens], expected, atol=ATOL_F32, rtol=0)
    out16, _, _ = both_paths(lib, q.bfloat16(), cache, meta, spec)
    expected16 = torch_paged._decode(q[tokens].bfloat16().float(), as_paged(cache), torch_index(meta, spec), spec)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16[tokens].float(), expected16, atol=2e-2, rtol=1e-2)  # bf16 output rounding


def decode_step(cache: torch.Tensor, meta: AttentionMetadata, heads: int, seed: int):
    """q/k/v of one decode step (every row decodes), and meta with the slots of each row's new token."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, dim = cache.shape[-2:]
    pos = meta.seq_lens - 1
    blocks = meta.block_tables.gather(1, (pos // meta.block_size)[:, None])[:, 0]
    meta = replace(meta, slot_mapping=blocks * meta.block_size + pos % meta.block_size)
    q = torch.randn(len(pos), heads, dim, generator=gen)
    k, v = torch.randn(2, len(pos), kv_heads, dim, generator=gen)
    return q, k, v, meta


def test_paged_attention_takes_the_kernel_on_cpu_and_torch_without_it(lib, monkeypatch):
    calls = {"torch": 0, "kernel": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(torch_paged, "_decode", counted("torch", torch_paged._decode))
    monkeypatch.setattr(torch_paged, "_kernel_decode", counted("kernel", torch_paged._kernel_decode))
    cache, meta = make_batch([5, 16, 90], 16, 2, 64, torch.float32, seed=11, prefill_between=False)
    spec = spec_for(4, 2, 64, WINDOW, None)
    q, k, v, meta = decode_step(cache, meta, 4, seed=12)

    with_kernel = paged_attention(q, k, v, cache.clone(), meta, spec)
    assert calls == {"torch": 0, "kernel": 1}

    monkeypatch.setattr(torch_paged, "attention_kernels", lambda: None)
    without = paged_attention(q, k, v, cache.clone(), meta, spec)
    assert calls == {"torch": 1, "kernel": 1}
    torch.testing.assert_close(with_kernel, without, atol=ATOL_F32, rtol=0)


def test_a_missing_compiler_leaves_the_torch_path_with_one_notice(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("VLLMPY_CACHE", str(tmp_path))
    kernels.attention_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="vllmpy"):
            assert kernels.attention_kernels() is None
            cache, meta = make_batch([3, 20], 16, 1, 64, torch.float32, seed=13, prefill_between=False)
            q, k, v, meta = decode_step(cache, meta, 2, seed=14)
            out = paged_attention(q, k, v, cache, meta, spec_for(2, 1, 64, None, None))
        assert out.isfinite().all()
        notices = [r.message for r in caplog.records if "paged-attention CPU kernel unavailable" in r.message]
        assert len(notices) == 1 and "torch" in notices[0]
    finally:
        kernels.attention_kernels.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_kernel_stores_the_steps_kv_as_torch_does(lib, dtype, monkeypatch):
    """A float cache of the model's dtype takes the step's K/V (decode and prefill rows, k/v strided views of a
    fused qkv output) inside the decode kernel's call: the cache and the output equal torch's writes first."""
    cache, meta = make_batch(SEQ_LENS, 16, 2, 64, dtype, seed=21)
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    slots = [int(meta.block_tables[r, p // 16]) * 16 + p % 16
             for r in range(len(lens)) for p in range(lens[r] - (starts[r + 1] - starts[r]), lens[r])]
    meta = replace(meta, slot_mapping=torch.tensor(slots))
    qkv = torch.randn(len(slots), 8, 64, generator=torch.Generator().manual_seed(22)).to(dtype)
    q, k, v = qkv.split_with_sizes((4, 2, 2), 1)
    spec = spec_for(4, 2, 64, WINDOW, None)
    assert torch_paged._kernel_writes(k, v, as_paged(cache))
    fused_cache, torch_cache = cache.clone(), cache.clone()
    fused = paged_attention(q, k, v, fused_cache, meta, spec)
    monkeypatch.setattr(torch_paged, "_kernel_writes", lambda *args: False)
    assert torch.equal(fused, paged_attention(q, k, v, torch_cache, meta, spec))
    assert torch.equal(fused_cache, torch_cache) and not torch.equal(fused_cache, cache)
