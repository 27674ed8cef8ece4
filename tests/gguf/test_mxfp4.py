"""GGML MXFP4 (type 39: an e8m0 scale byte and 16 bytes of e2m1 nibbles per 32 values) computed packed.

The decoder against gguf.quants.dequantize bit for bit (every scale byte, every code), and the matmuls within
a float32 summation bound, in the three builds the runtime dispatch picks from: this CPU's (-march=native:
AVX-512 here), AVX2 (-mno-avx512f) and the portable scalar one (no -march); then a qwen3moe GGUF whose expert
stacks are MXFP4 (gguf-py's quantizer) computes on the file's blocks with the dequantized model's tokens."""
from __future__ import annotations

import ctypes
import hashlib
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from vllmpy import kernels
from vllmpy.layers.quantized import PackedTensor, packed_linear
from vllmpy.loader.default_model import cache_dir

BUILDS = {"native": [], "avx2": ["-mno-avx512f"], "scalar": None}  # extra flags after -march=native; None: no -march
ROWS, COLS = 64, 512


def _library(build: str) -> ctypes.CDLL:
    """ggml_blocks.c as `build` compiles it: the package's own library for "native", else a build cached
    beside it under the name and key tests/gguf/test_packed_kernels.py gives its AVX2 builds (one compile)."""
    if build == "native":
        return kernels.block_kernels()
    extra = BUILDS[build]
    flags = kernels._FLAGS + ([] if extra is None else kernels._NATIVE + extra)
    source = kernels.Path(kernels.__file__).with_name("ggml_blocks.c")
    compiler = shutil.which("cc") or shutil.which("gcc")
    key = hashlib.sha256("\0".join([kernels._source_text(source), compiler, *flags, kernels._cpu_signature()]).encode())
    target = cache_dir() / "kernels" / f"ggml_blocks-test-{key.hexdigest()[:16]}.so"
    if not target.exists():
        kernels._compile(compiler, flags, source, target)
    return kernels._bind_blocks(ctypes.CDLL(str(target)))


def _cpu_has(flag: str) -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and f" {flag} " in f" {line.split(':')[1]} " for line in f)


def mxfp4_blocks(rng: np.random.Generator, rows: int, cols: int, scales=(0, 256)) -> np.ndarray:
    """[rows, bytes per row] of random codes; the scale bytes cycle through `scales` (all 256 by default)."""
    blocks = rng.integers(0, 256, (rows * cols // 32, 17), dtype=np.uint8)
    low, high = scales
    blocks[:, 0] = low + np.arange(len(blocks)) % (high - low)
    rng.shuffle(blocks[:, 0])
    return blocks.reshape(rows, -1)


def sum_bound(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """|float32 x @ weight.T - exact| for any summation order: gamma_(k+1) * sum |x_i w_i| with unit roundoff
    2^-24 (k + 1 roundings on each term's path: its product where not fused, the additions), ~1.002 k 2^-24;
    plus the row dots' 30-bit fixed-point x (up to 10 rows): 2^-30 of each 32-block's largest |x| per value
    (2^-29: a factor 2 of margin), as tests/gguf/test_packed_kernels.py's FIXED_RTOL."""
    k = x.shape[1]
    blocks_x = np.abs(x).reshape(x.shape[0], -1, 32).max(-1)
    blocks_w = np.abs(weight).reshape(weight.shape[0], -1, 32).sum(-1)
    return 1.01 * k * 2.0 ** -24 * (np.abs(x) @ np.abs(weight).T) + 2.0 ** -29 * (blocks_x @ blocks_w.T)


@pytest.fixture(scope="module", params=list(BUILDS))
def lib(request):
    if request.param == "avx2" and not _cpu_has("avx2"):
        pytest.skip("an AVX2 build needs an AVX2 CPU")  # the other two builds still run
    return _library(request.param)


def test_decoders_bit_identical_to_gguf(lib):
    rng = np.random.default_rng(39)
    data = mxfp4_blocks(rng, ROWS, COLS)
    assert set(data[:, ::17].reshape(-1)) == set(range(256))
    codes = np.concatenate([data.reshape(-1, 17)[:, 1:] & 0xF, data.reshape(-1, 17)[:, 1:] >> 4])
    assert set(codes.reshape(-1)) == set(range(16))
    with np.errstate(over="ignore"):  # 6 * 2^127: inf in gguf-py as in the kernel
        expected = dequantize(data, Q.MXFP4).reshape(ROWS, COLS)
    assert np.isinf(expected).any() and (np.abs(expected[expected != 0]) < 2.0 ** -126).any()  # edges: inf, subnormal
    ids = np.arange(ROWS, dtype=np.int64)[::-1].copy()
    rows = np.empty((ROWS, COLS), np.float32)
    lib.vq_decode_rows(int(Q.MXFP4), data.ctypes.data, data.shape[1], COLS, ids.ctypes.data, ROWS, rows.ctypes.data, 2)
    assert np.array_equal(rows.view(np.uint32), expected[::-1].view(np.uint32))
    first, count = 5, 40
    slab = np.empty((count, COLS), np.float32)
    lib.vq_decode_range(int(Q.MXFP4), data.ctypes.data, data.shape[1], COLS, first, count, slab.ctypes.data, 2)
    assert np.array_equal(slab.view(np.uint32), expected[first:first + count].view(np.uint32))
    slab16 = np.empty((count, COLS), np.uint16)
    lib.vq_decode_range_bf16(int(Q.MXFP4), data.ctypes.data, data.shape[1], COLS, first, count, slab16.ctypes.data, 2)
    bf16 = torch.from_numpy(expected[first:first + count]).to(torch.bfloat16).view(torch.int16).numpy()
    assert np.array_equal(slab16.view(np.int16), bf16)


def test_matmuls_within_the_summation_bound(lib):
    rng = np.random.default_rng(40)
    data = mxfp4_blocks(rng, ROWS, COLS, scales=(110, 135))  # finite weights, 2^-18 .. 2^7 * 6
    weight = dequantize(data, Q.MXFP4).reshape(ROWS, COLS).astype(np.float64)
    tiled = bool(lib.vq_matmul_tiled_built())
    for m in (1, 3, 10, 11, 64):
        x = rng.standard_normal((m, COLS)).astype(np.float32)
        expected, bound = x.astype(np.float64) @ weight.T, sum_bound(x.astype(np.float64), weight)
        kernels_here = [lib.vq_matmul] + ([lib.vq_matmul_tiled] if tiled and m > 10 else [])
        assert not lib.vq_matmul_small(int(Q.MXFP4), data.ctypes.data, data.shape[1], ROWS, COLS, x.ctypes.data, m,
                                       np.empty((m, ROWS), np.float32).ctypes.data, ROWS, 2)  # declines: no panels
        for kernel in kernels_here:
            y = np.full((m, ROWS), np.nan, np.float32)
            kernel(int(Q.MXFP4), data.ctypes.data, data.shape[1], ROWS, COLS, x.ctypes.data, m, y.ctypes.data, ROWS, 2)
            assert np.all(np.abs(y - expected) <= bound), (kernel.__name__, m)


def test_adversarial_activations(lib):
    """test_packed_kernels' activation rows that stress a per-block fixed-point scale (1e-30 beside 1e30 blocks,
    subnormals, zeros, outliers) through the row dots, a few rows at a time."""
    from tests.gguf.test_packed_kernels import adversarial_x

    rng = np.random.default_rng(42)
    data = mxfp4_blocks(rng, ROWS, COLS, scales=(110, 135))
    weight = dequantize(data, Q.MXFP4).reshape(ROWS, COLS).astype(np.float64)
    x = adversarial_x(COLS, rng)
    y = np.empty((len(x), ROWS), np.float32)
    for i in range(0, len(x), 3):
        m = min(3, len(x) - i)
        lib.vq_matmul(int(Q.MXFP4), data.ctypes.data, data.shape[1], ROWS, COLS, x[i:].ctypes.data, m,
                      y[i:].ctypes.data, ROWS, 2)
    error = np.abs(y - x.astype(np.float64) @ weight.T)
    assert np.all(error <= sum_bound(x.astype(np.float64), weight) + 2.0 ** -149) and np.all(y[7] == 0.0)


def test_packed_linear_on_every_row_count_path():
    """packed_linear's dispatch (few-row kernel, small-batch declining, tiled or slab) on the package's build."""
    rng = np.random.default_rng(41)
    data = mxfp4_blocks(rng, ROWS, COLS, scales=(110, 135))
    weight = dequantize(data, Q.MXFP4).reshape(ROWS, COLS).astype(np.float64)
    packed = PackedTensor.from_numpy(data, int(Q.MXFP4), (ROWS, COLS))
    assert PackedTensor.packable(int(Q.MXFP4), (ROWS, COLS)) and not PackedTensor.packable(int(Q.MXFP4), (ROWS, 48))
    for m in (1, 4, 16, 33, 200):
        x = torch.randn(m, COLS)
        got = packed_linear(x, packed).double().numpy()
        expected = x.double().numpy() @ weight.T
        assert np.all(np.abs(got - expected) <= sum_bound(x.double().numpy(), weight)), m


def test_qwen3moe_with_mxfp4_experts_stays_packed_and_matches_dequantized(smollm2_gguf_path, tmp_path, monkeypatch):
    """Expert stacks quantized by gguf-py to MXFP4 (as llama.cpp stores gpt-oss's): each expert computes on its
    slice of the file's blocks, no dense expert weight left, with the greedy tokens of the same file
    dequantized at load (VLLMPY_GGUF_KEEP_QUANT=0) token for token."""
    from tests.gguf.test_gguf_archs import _TOKENIZER_KEYS, _tiny
    from tests.models.test_batch_invariance import _agree, _outputs
    from vllmpy import LLM
    from vllmpy.layers.moe import ExpertLinear
    from vllmpy.loader.gguf.file import read_gguf

    reader = gguf.GGUFReader(smollm2_gguf_path)
    vocab = {key: reader.fields[key].contents() for key in _TOKENIZER_KEYS}
    _, path = _tiny("qwen3moe", vocab, tmp_path, expert_type=Q.MXFP4)
    _, tensors = read_gguf(str(path))
    file_bytes = sum(t.data.nbytes for t in tensors if "_exps." in t.name)
    assert {t.tensor_type for t in tensors if "_exps." in t.name} == {Q.MXFP4}
    packed = LLM(model=str(path), dtype="float32", num_blocks=64, block_size=16, max_model_len=256)
    stacks = [m for m in packed.engine.core.runner.model.modules() if isinstance(m, ExpertLinear)]
    assert stacks and all(m.packed is not None and m.weight.numel() == 0 for m in stacks)
    segments = [s for m in stacks for expert in m.packed for s in expert]
    assert {s.ggml_type for s in segments} == {int(Q.MXFP4)}
    assert sum(s.nbytes for s in segments) == file_bytes  # the experts hold the file's blocks, nothing dense
    prompts = ["The capital of France is", "1, 2, 3, 4, 5,"]
    kept = _outputs(packed, prompts)
    monkeypatch.setenv("VLLMPY_GGUF_KEEP_QUANT", "0")
    dense = LLM(model=str(path), dtype="float32", num_blocks=64, block_size=16, max_model_len=256)
    assert all(m.packed is None for m in dense.engine.core.runner.model.modules() if isinstance(m, ExpertLinear))
    assert _agree(_outputs(dense, prompts), kept, "mxfp4 packed experts vs dequantized") == 0
