"""Q4Z / Q8Z (GPTQ / AWQ / compressed-tensors zero points: value = d * (q - zero)) take the integer row dots, the
zero as Q4_1's min term -d * zero: in the native (AVX-512), AVX2 and portable builds the matmul stays within the
packed kernels' bound of the decoded weight, the extreme zeros included (Q4Z 0 and 16, Q8Z -128 and 128)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.gguf.test_mxfp4 import lib  # noqa: F401  the native, AVX2 and portable builds of ggml_blocks.c
from tests.gguf.test_packed_kernels import matmul_bound

ROWS, COLS = 48, 1024 + 96  # 35 blocks a row: the 4-block groups and a remainder of 3
Q4Z, Q8Z = 200, 201


def zero_point_blocks(rng: np.random.Generator, qtype: int, rows: int, cols: int) -> np.ndarray:
    """[rows, bytes per row]: random codes, fp16 scales, zeros over their whole range (both ends in the first blocks)."""
    n = rows * cols // 32
    size = 19 if qtype == Q4Z else 36
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-3, 2e-2, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    if qtype == Q4Z:
        blocks[:, 2] = np.concatenate([[0, 16], rng.integers(0, 17, n - 2)])
    else:
        zeros = np.concatenate([[-128, 128], rng.integers(-128, 129, n - 2)]).astype(np.int16)
        blocks[:, 2:4] = zeros.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q4Z, Q8Z], ids=["Q4Z", "Q8Z"])
def test_matmul_within_the_packed_bound(lib, qtype):
    rng = np.random.default_rng(qtype)
    data = zero_point_blocks(rng, qtype, ROWS, COLS)
    weight = np.empty((ROWS, COLS), np.float32)
    lib.vq_decode_range(qtype, data.ctypes.data, data.shape[1], COLS, 0, ROWS, weight.ctypes.data, 1)
    weight = weight.astype(np.float64)
    for m in (1, 3, 10, 64):
        x = rng.standard_normal((m, COLS)).astype(np.float32)
        x[0, :COLS // 2] *= 1e-6  # blocks far apart in scale
        y = np.full((m, ROWS), np.nan, np.float32)
        lib.vq_matmul(qtype, data.ctypes.data, data.shape[1], ROWS, COLS, x.ctypes.data, m, y.ctypes.data, ROWS, 2)
        x64 = x.astype(np.float64)
        assert np.all(np.abs(y - x64 @ weight.T) <= matmul_bound(x64, weight)), m
