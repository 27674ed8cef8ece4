"""The small-batch kernel's AMX-INT8 tiles (vllmpy/kernels/amx_small.h): taken exactly where the CPU has AMX,
and bit-identical to the VNNI panels they replace (same int16 activations split exactly into bytes, same int32
group sums, same float operations), so the float64 bound of test_packed_kernels holds for both and a batch
gives the same logits whichever of the two ran it."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tests.gguf.test_packed_kernels import SMALL_TYPES, _cpu_has, random_blocks
from vllmpy import kernels


def test_amx_tiles_taken_exactly_where_the_cpu_has_them():
    assert bool(kernels.block_kernels().vq_matmul_small_amx(-1)) == (_cpu_has("amx_tile") and _cpu_has("amx_int8"))


def _small(lib, qtype: Q, data: np.ndarray, n: int, k: int, x: np.ndarray, threads: int) -> np.ndarray:
    y = np.full((x.shape[0], n + 7), -7.0, np.float32)  # a wider y: the kernel writes columns 3 .. 3 + n only
    assert lib.vq_matmul_small(int(qtype), data.ctypes.data, data.shape[1], n, k, x.ctypes.data, x.shape[0],
                               y.ctypes.data + 4 * 3, n + 7, threads) == 1
    return y


@pytest.mark.parametrize("qtype", sorted(SMALL_TYPES), ids=lambda t: t.name)
def test_amx_tiles_equal_the_vnni_panels(qtype):
    """Ragged shapes (weight rows not a multiple of 16, activation tiles part-filled), rows of extreme scale
    (a unit outside float's normal range takes the double path), a row with a NaN, 1 and 2 threads."""
    lib, rng = kernels.block_kernels(), np.random.default_rng(700 + int(qtype))
    try:
        for n, k in ((37, 512), (100, 1024)):
            data = random_blocks(qtype, n, k, rng)
            for m in (4, 9, 16, 17, 32):
                x = rng.standard_normal((m, k)).astype(np.float32)
                x[1] *= 1e-38
                x[2] *= 1e30
                x[3, 40] = np.nan
                for threads in (1, 2):
                    lib.vq_matmul_small_amx(0)
                    panels = _small(lib, qtype, data, n, k, x, threads)
                    lib.vq_matmul_small_amx(1)
                    tiles = _small(lib, qtype, data, n, k, x, threads)
                    assert np.array_equal(panels, tiles, equal_nan=True), (qtype.name, n, k, m, threads)
                    assert np.isnan(tiles[3, 3:3 + n]).all() and not np.isnan(np.delete(tiles, 3, 0)).any()
    finally:
        lib.vq_matmul_small_amx(1)
