"""kernels/block_fma.c: F8S (fp8 e4m3 safetensors), Q4Z / Q8Z / Q4ZF / Q8ZF (zero points), MXFP4, F16 and BF16 blocks
decoded into float registers and multiplied into up to 8 activation rows at once, in the native (AVX-512
here), AVX2 (-mno-avx512f) and portable (no -march: declines every call) builds:
- every weight value multiplied (F16 / BF16 too: a quantized checkpoint's mapped embedding / head) is
  bit-identical to the block library's decoder (one-hot activations read
  single weights out; fp8: all 256 codes under scales from subnormal to 2^126, both product orders);
- the matmul stays within a float32 summation bound of the decoded weight, and a row's result does not
  depend on how many rows share the call;
- each type is taken for exactly its documented row range (F8S / Q4ZF / Q8ZF / F16 / BF16 from 1 row,
  Q4Z / Q8Z / MXFP4 from 11; up to 24 rows with AVX-512, 12 with AVX2), other types declined; an fp8 row holding a NaN code gives NaN results;
  packed_linear takes the kernel for those rows."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tests.gguf.test_mxfp4 import BUILDS, _cpu_has, mxfp4_blocks, sum_bound
from tests.quant.test_zero_point_row_dots import zero_point_blocks
from vllmpy import kernels
from vllmpy.layers.quantized import PackedTensor, packed_linear

F8S, Q4Z, Q8Z, Q4ZF, Q8ZF, MXFP4, F16, BF16 = 202, 200, 201, 203, 204, 39, 1, 30
TYPES = [F8S, Q4Z, Q8Z, Q4ZF, Q8ZF, MXFP4, F16, BF16]
IDS = ["F8S", "Q4Z", "Q8Z", "Q4ZF", "Q8ZF", "MXFP4", "F16", "BF16"]
# no vector decoder in the block library: taken from 1 row (the others after its integer row dots' 10)
FROM_ONE = {F8S, Q4ZF, Q8ZF, F16, BF16}
# 256 s exact, and not (>= 2^119); products that overflow are left out of the one-hot test (0 * inf is NaN)
SCALES = np.array([2.0 ** -140, 1e-3, 0.37, 3.0, 2.0 ** 119, 2.0 ** 126], np.float32)


def _library(build: str) -> ctypes.CDLL:
    """block_fma.c as `build` compiles it ("native": the package's own), cached as the package caches it."""
    if build == "native":
        return kernels.block_fma_kernels()
    extra = BUILDS[build]
    flags = kernels._FLAGS + ([] if extra is None else kernels._NATIVE + extra)
    path = kernels._build(kernels.Path(kernels.__file__).with_name("block_fma.c"), (flags,))
    return kernels._bind_block_fma(ctypes.CDLL(str(path)))


def _build(name: str) -> tuple[str, ctypes.CDLL]:
    if name == "avx2" and not _cpu_has("avx2"):
        pytest.skip("an AVX2 build needs an AVX2 CPU")  # the other builds still run
    return name, _library(name)


@pytest.fixture(scope="module", params=list(BUILDS))
def build(request) -> tuple[str, ctypes.CDLL]:
    """Every build, the portable one (which declines every call) included."""
    return _build(request.param)


@pytest.fixture(scope="module", params=["native", "avx2"])
def simd(request) -> tuple[str, ctypes.CDLL]:
    """The builds that compute."""
    return _build(request.param)


def rows_taken(build: str, qtype: int) -> range:
    """The documented activation-row range the build takes for `qtype` (empty: declined)."""
    if build == "scalar":
        return range(0)
    return range(1 if qtype in FROM_ONE else 11, (24 if build == "native" and _cpu_has("avx512f") else 12) + 1)


def f8s_blocks(rng: np.random.Generator, rows: int, cols: int, scales: np.ndarray = SCALES) -> np.ndarray:
    """[rows, bytes per row]: random codes (no NaN codes) and one of `scales` per block."""
    n = rows * cols // 32
    blocks = np.empty((n, 36), np.uint8)
    blocks[:, :4] = rng.choice(scales.astype(np.float32), n).view(np.uint8).reshape(n, 4)
    codes = rng.integers(0, 256, (n, 32), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] ^= 1
    blocks[:, 4:] = codes
    return blocks.reshape(rows, -1)


def float_zero_blocks(rng: np.random.Generator, qtype: int, rows: int, cols: int) -> np.ndarray:
    """Q4ZF (f32 d, u8 zero, 3 pad, 16 nibble bytes) / Q8ZF (f32 d, i16 zero, 2 pad, 32 int8) blocks."""
    n = rows * cols // 32
    blocks = rng.integers(0, 256, (n, 24 if qtype == Q4ZF else 40), dtype=np.uint8)
    blocks[:, :4] = (rng.uniform(1e-3, 2e-2, n) * rng.choice([1e-30, 1.0], n)).astype(np.float32).view(np.uint8)\
        .reshape(n, 4)
    if qtype == Q4ZF:
        blocks[:, 4] = rng.integers(0, 17, n)
    else:
        blocks[:, 4:6] = rng.integers(-128, 129, n).astype(np.int16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def blocks_of(qtype: int, rng: np.random.Generator, rows: int, cols: int, finite: bool = False) -> np.ndarray:
    if qtype == F8S:
        return f8s_blocks(rng, rows, cols, np.array([2e-3, 0.5]) if finite else SCALES)
    if qtype in (Q4Z, Q8Z):
        return zero_point_blocks(rng, qtype, rows, cols)
    if qtype in (Q4ZF, Q8ZF):
        return float_zero_blocks(rng, qtype, rows, cols)
    if qtype in (F16, BF16):  # runs of 32 values; subnormal to large magnitudes
        values = torch.from_numpy(rng.standard_normal((rows, cols)) * 10.0 ** rng.integers(-6, 4, (rows, cols)))
        return values.to(torch.float16 if qtype == F16 else torch.bfloat16).view(torch.uint8).numpy().copy()
    return mxfp4_blocks(rng, rows, cols, (100, 150) if finite else (0, 250))


def decoded(qtype: int, data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """The block library's decode of every value."""
    out = np.empty((rows, cols), np.float32)
    kernels.block_kernels().vq_decode_range(qtype, data.ctypes.data, data.shape[1], cols, 0, rows, out.ctypes.data, 1)
    return out


def matmul(lib: ctypes.CDLL, qtype: int, data: np.ndarray, x: np.ndarray, rows: int, threads: int = 1):
    """y, or None where the kernel declined."""
    y = np.full((x.shape[0], rows), -7.0, np.float32)
    taken = lib.vq_block_fma_matmul(qtype, data.ctypes.data, data.shape[1], rows, x.shape[1], x.ctypes.data,
                                    x.shape[0], y.ctypes.data, rows, threads)
    assert taken in (0, 1) and (taken or (y == -7.0).all())
    return y if taken else None


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_each_type_is_taken_for_its_documented_rows(build, qtype):
    name, lib = build
    data = blocks_of(qtype, np.random.default_rng(1), 4, 64, finite=True)
    taken = {m for m in range(1, 34) if matmul(lib, qtype, data, np.ones((m, 64), np.float32), 4) is not None}
    assert taken == set(rows_taken(name, qtype))
    assert matmul(lib, 8, np.zeros((4, 68), np.uint8), np.ones((12, 64), np.float32), 4) is None  # Q8_0


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_every_value_multiplied_is_the_library_decode_bit_for_bit(simd, qtype):
    name, lib = simd
    rng = np.random.default_rng(qtype)
    rows, cols = (len(SCALES), 256) if qtype == F8S else (8, 384)
    data = blocks_of(qtype, rng, rows, cols)
    if qtype == F8S:  # all 256 codes (NaN codes aside) under every scale: row r holds them under SCALES[r]
        blocks = data.reshape(rows, -1, 36)
        blocks[:, :, :4] = np.repeat(SCALES, cols // 32).view(np.uint8).reshape(rows, -1, 4)
        codes = np.arange(256, dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0
        blocks[:, :, 4:] = codes.reshape(-1, 32)
        blocks[:, :, 4:][np.isinf(decoded(qtype, data, rows, cols)).reshape(rows, -1, 32)] = 0
    expected = decoded(qtype, data, rows, cols)
    assert np.isfinite(expected).all()
    for first in range(0, cols, 12):  # 12 one-hot rows per call (every build's range holds 12)
        count = min(12, cols - first)
        x = np.zeros((12, cols), np.float32)
        x[np.arange(count), first + np.arange(count)] = 1.0
        np.testing.assert_array_equal(matmul(lib, qtype, data, x, rows).T[:, :count], expected[:, first:first + count])


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_matmul_within_the_float32_bound_and_batch_invariant(simd, qtype):
    name, lib = simd
    rng = np.random.default_rng(qtype + 1)
    rows, cols = 40, 1024 + 96
    data = blocks_of(qtype, rng, rows, cols, finite=True)
    weight = decoded(qtype, data, rows, cols).astype(np.float64)
    x = rng.standard_normal((24, cols)).astype(np.float32)
    x[0, :cols // 2] *= 1e-6
    x64 = x.astype(np.float64)
    alone = matmul(lib, qtype, data, x[:1], rows)
    taken = rows_taken(name, qtype)
    for m in sorted({taken.start, 2, 7, 8, 9, 12, 13, taken.stop - 1} & set(taken)):  # row groups of 8 (AVX2: 2)
        y = matmul(lib, qtype, data, x[:m], rows, threads=2)
        assert np.all(np.abs(y - x64[:m] @ weight.T) <= sum_bound(x64[:m], weight)), m
        if alone is not None:
            np.testing.assert_array_equal(y[0], alone[0])  # the same row alone and in a batch


def test_an_fp8_nan_code_makes_its_row_nan(simd):
    _, lib = simd
    rng = np.random.default_rng(7)
    data = f8s_blocks(rng, 4, 64, np.array([1e-2]))
    data[1, 36 + 4 + 5] = 0xFF  # -NaN in row 1, second block
    data[2, 4 + 9] = 0x7F
    y = matmul(lib, F8S, data, rng.standard_normal((3, 64)).astype(np.float32), 4)
    assert np.isnan(y[:, 1:3]).all() and np.isfinite(y[:, [0, 3]]).all()


@pytest.mark.parametrize("qtype,m", [(F8S, 1), (F8S, 5), (Q8ZF, 3), (Q4Z, 12), (MXFP4, 16)])
def test_packed_linear_takes_the_kernel(qtype, m):
    rng = np.random.default_rng(3)
    rows, cols = 48, 256
    data = blocks_of(qtype, rng, rows, cols, finite=True)
    weight = PackedTensor(torch.from_numpy(data), qtype, (rows, cols))
    x = torch.from_numpy(rng.standard_normal((m, cols)).astype(np.float32))
    expected = matmul(kernels.block_fma_kernels(), qtype, data, x.numpy(), rows)
    assert expected is not None
    np.testing.assert_array_equal(packed_linear(x, weight).numpy(), expected)
