"""Quantized KV caches (vllmpy/attention/kv_storage.py): the fp8 and int8 round trips within their
formats' error, page sizes, and the C decode kernel reading fp8 / int8 in place — its AVX-512, AVX2 and
scalar builds — against the torch path on the same stored values (paged_decode.c must decode exactly
what the writer stored, so only summation order differs)."""
from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from vllmpy import kernels
from vllmpy.attention import torch_paged
from vllmpy.attention.base import AttentionSpec
from vllmpy.attention.kv_storage import dequantize_int8, int8_group, quantize_fp8, quantize_int8
from vllmpy.engine.kv_cache_spec import FullAttentionSpec
from tests.attention.test_paged_decode_kernel import make_batch, torch_index

QUANTIZED = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
# Builds of the kernel the machine can run, by the widest vector path each takes.
BUILDS = {"native": ["-march=native"], "avx2": ["-mavx2", "-mfma", "-mf16c"], "scalar": []}


def test_fp8_round_trip_within_half_an_ulp_of_the_format():
    x = torch.randn(4096) * 3
    for dtype, mantissa_bits in ((torch.float8_e4m3fn, 3), (torch.float8_e5m2, 2)):
        back = quantize_fp8(x, 0.5, dtype).float() * 0.5
        normal = x.abs() > 2.0 ** -5  # above both formats' subnormal range at scale 0.5
        rel = ((back - x).abs() / x.abs())[normal]
        assert rel.max() <= 2.0 ** -(mantissa_bits + 1) + 1e-6
    saturated = quantize_fp8(torch.tensor([1e6, -1e6]), 1.0, torch.float8_e4m3fn).float()
    assert saturated.tolist() == [448.0, -448.0]  # clamped to the largest finite value, never NaN


@pytest.mark.parametrize("dim", [256, 80, 8])
def test_int8_round_trip_within_half_a_step_of_each_group(dim):
    x = torch.randn(64, 2, dim) * torch.logspace(-3, 3, 64)[:, None, None]  # groups of very different ranges
    codes, scales = quantize_int8(x)
    group = int8_group(dim)
    assert group == {256: 32, 80: 16, 8: 8}[dim] and scales.shape == (64, 2, dim // group)
    step = scales.float().repeat_interleave(group, dim=-1)
    err = (dequantize_int8(codes, scales, torch.float32) - x).abs()
    assert (err <= step * 0.5 + step * 2.0 ** -10 * 127).all()  # half a step, plus the fp16 scale's rounding
    assert quantize_int8(torch.zeros(1, 1, dim))[0].eq(0).all()  # an all-zero group stays zero


def test_page_bytes_per_storage_dtype():
    page = {dtype: FullAttentionSpec(16, 1, 256, dtype).page_bytes
            for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8)}
    assert page[torch.float32] == 4 * page[torch.float8_e4m3fn] == 2 * page[torch.bfloat16]
    assert page[torch.int8] == page[torch.float8_e4m3fn] * 17 // 16  # an fp16 scale per 32 values


def _build(flags: list[str], tmp_path) -> ctypes.CDLL:
    target = tmp_path / f"paged_attention-{'-'.join(flags) or 'plain'}.so"
    source = kernels.Path(kernels.__file__).with_name("paged_attention.c")
    kernels._compile("cc", kernels._FLAGS + flags, source, target)
    return kernels._bind_attention(ctypes.CDLL(str(target)))


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.fail("these builds name x86 flags")
    out = tmp_path_factory.mktemp("kernels")
    return {name: _build(flags, out) for name, flags in BUILDS.items()}


def _quantized_cache(dtype: torch.dtype, dim: int, seq_lens: list[int], seed: int):
    """make_batch's random cache stored as `dtype` (fp8 with non-unit scales), and its metadata."""
    plain, meta = make_batch(seq_lens, 16, 2, dim, torch.float32, seed)
    spec = FullAttentionSpec(16, 2, dim, dtype)
    num_blocks = plain.shape[1]
    cache = spec.view(torch.zeros(spec.page_bytes * num_blocks, dtype=torch.uint8), num_blocks)
    cache.k_scale, cache.v_scale = 0.25, 3.0
    cache.write(plain[0].reshape(-1, 2, dim), plain[1].reshape(-1, 2, dim), torch.arange(num_blocks * 16))
    return cache, meta


@pytest.mark.parametrize("dtype", QUANTIZED, ids=["e4m3", "e5m2", "int8"])
@pytest.mark.parametrize("dim", [256, 80])
@pytest.mark.parametrize("window", [None, 40], ids=["full", "window40"])
def test_kernel_builds_read_quantized_caches_as_the_torch_path(builds, dtype, dim, window):
    cache, meta = _quantized_cache(dtype, dim, [2, 16, 77, 300], seed=dim)
    spec = AttentionSpec(8, 2, dim, scale=dim ** -0.5, sliding_window=window)
    q = torch.randn(int(meta.query_start_loc[-1]), 8, dim)
    tokens = meta.decode.token_idx
    expected = torch_paged._decode(q[tokens], cache, torch_index(meta, spec), spec)
    for name, lib in builds.items():
        out = torch.full_like(q, float("nan"))
        torch_paged._kernel_decode(lib, q, cache, meta.decode, spec, out, tokens)
        torch.testing.assert_close(out[tokens], expected, atol=2e-5, rtol=0, msg=f"{name} build")
