"""Q4Z / Q8Z / Q4Z128 (GPTQ / AWQ / compressed-tensors zero points: value = d * (q - zero)) take the integer row dots
(Q4Z / Q8Z with the zero as Q4_1's min term -d * zero, Q4Z128 with the zero subtracted from the codes): in the native
(AVX-512), AVX2 and portable builds the matmuls (row dots, and the tiled kernel where built) stay within the packed
kernels' bound of the decoded weight, adversarial activations and the extreme zeros included (0 and 16, -128 and
128); Q4Z128's decoders (scalar rows, vectorized float32 and bf16 slabs) are bit-identical to its layout's
definition, written here."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gguf.test_mxfp4 import lib  # noqa: F401  the native, AVX2 and portable builds of ggml_blocks.c
from tests.gguf.test_packed_kernels import adversarial_x, matmul_bound

ROWS = 48
Q4Z, Q8Z, Q4Z128 = 200, 201, 205
# (values, bytes) per block; 35 Q4Z / Q8Z blocks a row (the row dots' 4-block groups and a remainder of 3), 9 Q4Z128
LAYOUTS = {Q4Z: (32, 19), Q8Z: (32, 36), Q4Z128: (128, 67)}
COLS = {Q4Z: 1024 + 96, Q8Z: 1024 + 96, Q4Z128: 9 * 128}
IDS = {Q4Z: "Q4Z", Q8Z: "Q8Z", Q4Z128: "Q4Z128"}
# fp16 scales at the edges (subnormal, largest finite, signed zeros, negative) beside ordinary ones
EDGE_SCALES = np.array([2.0 ** -24, 6.1e-5, 65504.0, 0.0, -0.0, -0.013], np.float16)


def zero_point_blocks(rng: np.random.Generator, qtype: int, rows: int, cols: int) -> np.ndarray:
    """[rows, bytes per row]: random codes, fp16 scales, zeros over their whole range (both ends in the first blocks)."""
    block, size = LAYOUTS[qtype]
    n = rows * cols // block
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-3, 2e-2, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    if qtype == Q8Z:
        zeros = np.concatenate([[-128, 128], rng.integers(-128, 129, n - 2)]).astype(np.int16)
        blocks[:, 2:4] = zeros.view(np.uint8).reshape(n, 2)
    else:
        blocks[:, 2] = np.concatenate([[0, 16], rng.integers(0, 17, n - 2)])
    return blocks.reshape(rows, -1)


def q4z128_values(data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q4Z128 by definition: d (fp16), zero (u8), 64 code bytes; byte 32 h + l holds value 64 h + l in its low
    nibble and 64 h + 32 + l in its high one; value = float32(d) * float32(q - zero), one rounding."""
    blocks = data.reshape(-1, 67)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    codes = blocks[:, 3:].reshape(-1, 2, 1, 32)
    q = np.concatenate([codes & 0xF, codes >> 4], axis=2).reshape(-1, 128).astype(np.int32)
    return (d * (q - blocks[:, 2:3].astype(np.int32)).astype(np.float32)).reshape(rows, cols)


def test_q4z128_decoders_bit_identical(lib):
    rng = np.random.default_rng(205)
    cols = COLS[Q4Z128]
    data = zero_point_blocks(rng, Q4Z128, ROWS, cols)
    blocks = data.reshape(-1, 67)
    blocks[::7, :2] = rng.choice(EDGE_SCALES, len(blocks[::7])).view(np.uint8).reshape(-1, 2)
    expected = q4z128_values(data, ROWS, cols)
    ids = np.arange(ROWS, dtype=np.int64)[::-1].copy()
    rows = np.empty((ROWS, cols), np.float32)
    lib.vq_decode_rows(Q4Z128, data.ctypes.data, data.shape[1], cols, ids.ctypes.data, ROWS, rows.ctypes.data, 2)
    assert np.array_equal(rows.view(np.uint32), expected[::-1].view(np.uint32))
    first, count = 5, 40
    slab = np.empty((count, cols), np.float32)
    lib.vq_decode_range(Q4Z128, data.ctypes.data, data.shape[1], cols, first, count, slab.ctypes.data, 2)
    assert np.array_equal(slab.view(np.uint32), expected[first:first + count].view(np.uint32))
    slab16 = np.empty((count, cols), np.uint16)
    lib.vq_decode_range_bf16(Q4Z128, data.ctypes.data, data.shape[1], cols, first, count, slab16.ctypes.data, 2)
    bf16 = torch.from_numpy(expected[first:first + count]).to(torch.bfloat16).view(torch.int16).numpy()
    assert np.array_equal(slab16.view(np.int16), bf16)


def _decoded(lib, qtype: int, data: np.ndarray, cols: int) -> np.ndarray:
    weight = np.empty((ROWS, cols), np.float32)
    lib.vq_decode_range(qtype, data.ctypes.data, data.shape[1], cols, 0, ROWS, weight.ctypes.data, 1)
    return weight.astype(np.float64)


@pytest.mark.parametrize("qtype", list(LAYOUTS), ids=IDS.get)
def test_matmul_within_the_packed_bound(lib, qtype):
    rng = np.random.default_rng(qtype)
    cols = COLS[qtype]
    data = zero_point_blocks(rng, qtype, ROWS, cols)
    weight = _decoded(lib, qtype, data, cols)
    tiled = bool(lib.vq_matmul_tiled_built())
    for m in (1, 3, 10, 11, 64):
        x = rng.standard_normal((m, cols)).astype(np.float32)
        x[0, :cols // 2] *= 1e-6  # blocks far apart in scale
        x64 = x.astype(np.float64)
        for kernel in [lib.vq_matmul] + ([lib.vq_matmul_tiled] if tiled and m > 10 else []):
            y = np.full((m, ROWS), np.nan, np.float32)
            kernel(qtype, data.ctypes.data, data.shape[1], ROWS, cols, x.ctypes.data, m, y.ctypes.data, ROWS, 2)
            assert np.all(np.abs(y - x64 @ weight.T) <= matmul_bound(x64, weight)), (kernel.__name__, m)


@pytest.mark.parametrize("qtype", list(LAYOUTS), ids=IDS.get)
def test_adversarial_activations(lib, qtype):
    """test_packed_kernels' rows that stress a per-block fixed-point scale (1e-30 beside 1e30 blocks, subnormals,
    zeros, outliers), 3 rows a call."""
    rng = np.random.default_rng(300 + qtype)
    cols = COLS[qtype]
    data = zero_point_blocks(rng, qtype, ROWS, cols)
    weight = _decoded(lib, qtype, data, cols)
    x = adversarial_x(cols, rng)
    y = np.empty((len(x), ROWS), np.float32)
    for i in range(0, len(x), 3):
        lib.vq_matmul(qtype, data.ctypes.data, data.shape[1], ROWS, cols, x[i:].ctypes.data, min(3, len(x) - i),
                      y[i:].ctypes.data, ROWS, 2)
    error = np.abs(y - x.astype(np.float64) @ weight.T)
    assert np.all(error <= matmul_bound(x.astype(np.float64), weight) + 2.0 ** -149) and np.all(y[7] == 0.0)
