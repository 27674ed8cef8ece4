"""The block kernels against gguf-py's reference dequantizer: decoded rows bit-identical, matmuls
within matmul_bound of float64 on the decoded weights; on random blocks of every type, on the real
blocks of the two shipped GGUF files, and on adversarial activations."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from vllmpy import kernels
import vllmpy.layers.quantized as quantized
from vllmpy.layers.quantized import KERNEL_MAX_ROWS, SMALL_MAX_ROWS, SMALL_MIN_ROWS, PackedTensor, packed_linear
from vllmpy.loader.gguf.file import read_gguf
from vllmpy.loader.gguf.quant import hf_shape

# Float32 summation vs float64 over the same decoded weights, relative to sum |x_i w_i|.
MATMUL_RTOL = 2e-5
# The few-row kernel also rounds x to a 30-bit fixed point per 32-value block (integer dot products):
# at most 2^-30 of the block's largest |x| per value, so relative to sum_b max|x_b| * sum_{i in b} |w_i|
# (2^-29: a factor 2 of margin). For ordinary activations this is ~1e-9 of sum |x_i w_i|.
FIXED_RTOL = 2.0 ** -29
# The small-batch kernel (SMALL_MIN_ROWS to SMALL_MAX_ROWS rows) rounds x to int16 per 32-value block with a
# power-of-two scale: at most 2^-14 of the block's largest |x| per value, so relative to
# sum_b max|x_b| * sum_{i in b} |w_i| (2^-13: a factor 2 of margin). For N(0, 1) activations ~3e-6 of it.
SMALL_RTOL = 2.0 ** -13
# The block types the small-batch kernel has integer panels for (the others keep the few-row and tiled kernels).
SMALL_TYPES = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.Q4_K, Q.Q5_K, Q.Q6_K}
# Byte offsets of each type's fp16 scale fields inside a block (random bytes there could be NaN/Inf).
_HALF_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q2_K: (80, 82),
                Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}
TYPES = [*_HALF_FIELDS, Q.F16, Q.BF16]


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes as [rows, bytes per row] with finite, O(0.01) scales."""
    if qtype == Q.F16:
        return rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        return (rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset in _HALF_FIELDS[qtype]:
        blocks[:, offset:offset + 2] = rng.uniform(0.001, 0.02, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def matmul_bound(x: np.ndarray, weight: np.ndarray, small: bool = False) -> np.ndarray:
    """The error bound of x @ weight.T (float64 arrays) against exact arithmetic: float32 summation
    plus the kernel's rounding of x (30-bit fixed point, or int16 where `small`: the small-batch kernel)."""
    blocks_x = np.abs(x).reshape(x.shape[0], -1, 32).max(-1)
    blocks_w = np.abs(weight).reshape(weight.shape[0], -1, 32).sum(-1)
    rounding = SMALL_RTOL if small else FIXED_RTOL
    return MATMUL_RTOL * (np.abs(x) @ np.abs(weight).T) + rounding * (blocks_x @ blocks_w.T)


def takes_small(qtype: Q, rows: int) -> bool:
    """Whether packed_linear sends `rows` activation rows of this block type to the small-batch kernel."""
    return qtype in SMALL_TYPES and SMALL_MIN_ROWS <= rows <= SMALL_MAX_ROWS


def check_packed(data: np.ndarray, qtype: Q, shape: tuple[int, int], sample_rows: list[int]) -> None:
    packed = PackedTensor.from_numpy(data, int(qtype), shape)
    reference = dequantize(data[sample_rows], qtype).reshape(len(sample_rows), shape[1])
    got = packed.rows(torch.tensor(sample_rows)).numpy()
    assert np.array_equal(got, reference), f"{qtype.name}: decoded rows differ from gguf.quants.dequantize"
    weight = dequantize(data[:256], qtype).reshape(-1, shape[1]).astype(np.float64)
    head = PackedTensor.from_numpy(data[:256], int(qtype), (weight.shape[0], shape[1]))
    for m in (1, SMALL_MIN_ROWS - 1, SMALL_MIN_ROWS, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, SMALL_MAX_ROWS,
              SMALL_MAX_ROWS + 1):  # the few-row, small-batch and tiled kernels and the slab path
        x = torch.randn(m, shape[1])
        expected = x.double().numpy() @ weight.T
        got = packed_linear(x, head).double().numpy()
        bound = matmul_bound(x.double().numpy(), weight, takes_small(qtype, m))
        assert np.all(np.abs(got - expected) <= bound + 1e-30), f"{qtype.name} m={m}"


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if kernels.block_kernels() is None:
        pytest.fail("the block kernels did not build on this machine (a C compiler is part of the setup)")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks(qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 300, 512
    check_packed(random_blocks(qtype, rows, cols, rng), qtype, (rows, cols), [0, 7, 150, rows - 1])


def adversarial_x(k: int, rng: np.random.Generator) -> np.ndarray:
    """Eight activation rows that stress a per-block fixed-point scale."""
    x = rng.standard_normal((8, k))
    x[0] *= 1e-6
    x[0, 3::32] = 1e4                      # one huge value per block, tiny others
    x[1] = 0.0                             # all-zero blocks, negative zeros, one lone value
    x[1, 32:96] = -0.0
    x[1, 100] = 3.0
    x[2, : k // 2] *= 1e-30                # 1e-30 blocks next to 1e30 blocks (2^200 apart)
    x[2, k // 2:] *= 1e30
    x[3] *= 1e-30                          # every block tiny (a row scale far from 1)
    x[4] *= 1e30                           # every block huge
    x[5, ::2] = 0.0                        # subnormal and near-FLT_MIN values
    x[5, 1::2] *= 1e-38
    x[5, 7] = 1e-45
    x[6, ::64] *= 1e6                      # one outlier every other block, signs mixed
    x[7] = -0.0                            # a row of negative zeros
    return x.astype(np.float32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_adversarial_activations(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    rows, cols = 64, 512
    data = random_blocks(qtype, rows, cols, rng)
    weight = dequantize(data, qtype).reshape(rows, cols).astype(np.float64)
    x = adversarial_x(cols, rng)
    packed = PackedTensor.from_numpy(data, int(qtype), (rows, cols))
    expected = x.astype(np.float64) @ weight.T
    few = SMALL_MIN_ROWS - 1
    for chunk in (few, len(x)):  # through the few-row kernel, then (the types it has) the small-batch kernel
        got = np.concatenate([packed_linear(torch.from_numpy(x[i:i + chunk]), packed).double().numpy()
                              for i in range(0, len(x), chunk)])
        bound = matmul_bound(x.astype(np.float64), weight, takes_small(qtype, chunk))
        # float32 output: values below FLT_MIN are rounded to a multiple of 2^-149
        assert np.all(np.abs(got - expected) <= bound + 2.0 ** -149), (qtype.name, chunk)
        assert np.all(got[7] == 0.0)


@pytest.mark.parametrize("m", [3, SMALL_MIN_ROWS + 1])  # the few-row and the small-batch kernel
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_non_finite_activations_stay_in_their_row(qtype, m):
    rng = np.random.default_rng(5)
    rows, cols = 16, 256
    packed = PackedTensor.from_numpy(random_blocks(qtype, rows, cols, rng), int(qtype), (rows, cols))
    x = rng.standard_normal((m, cols)).astype(np.float32)
    x[0, 40], x[2, 200] = np.nan, np.inf
    got = packed_linear(torch.from_numpy(x), packed).numpy()
    assert not np.isfinite(got[0]).any() and not np.isfinite(got[2]).any()
    assert np.isfinite(got[1]).all() and np.isfinite(got[3:]).all()


def _real_tensors(path: str) -> dict[Q, object]:
    _, tensors = read_gguf(path)
    firsts = {}
    for tensor in tensors:
        if len(tensor.shape) == 2 and tensor.tensor_type != Q.F32:
            firsts.setdefault(tensor.tensor_type, tensor)
    return firsts


def test_real_blocks_of_both_shipped_files(gemma3_gguf_path, smollm2_gguf_path):
    seen = set()
    for path in (gemma3_gguf_path, smollm2_gguf_path):
        for qtype, tensor in _real_tensors(path).items():
            shape = hf_shape(tensor)
            check_packed(tensor.data, qtype, shape, [0, 1, shape[0] // 2, shape[0] - 1])
            seen.add(qtype.name)
    assert {"Q8_0", "Q4_K", "Q6_K", "Q4_1"} <= seen, seen


def test_a_missing_compiler_falls_back_with_one_notice(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("VLLMPY_CACHE", str(tmp_path))
    kernels.block_kernels.cache_clear()
    kernels.block_layout.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="vllmpy"):
            assert kernels.block_kernels() is None
        notices = [r.message for r in caplog.records if "quantized CPU kernels unavailable" in r.message]
        assert len(notices) == 1 and "dequantized at load" in notices[0]
        assert not PackedTensor.packable(int(Q.Q4_K), (16, 256))  # so the loader takes the dense path
    finally:
        kernels.block_kernels.cache_clear()
        kernels.block_layout.cache_clear()


def test_model_on_packed_blocks_equals_the_dequantized_model(tmp_path):
    """A llama GGUF mixing block types inside fused projections: q/k/v of two types (two packed
    segments), an F32 shard among packed ones (expanded to dense), q/k rows un-permuted on packed
    bytes, a packed tied table. Every projection and the embedding agree with the dequantized model."""
    from tests.gguf.test_gguf_loader import _encode, _hparams, _weights, _write
    from vllmpy.layers.linear import Linear
    from vllmpy.loader.gguf import GGUFCheckpoint
    from vllmpy.models.registry import resolve_model_class

    rng = np.random.default_rng(3)
    values = _weights(hidden=256, heads=4, kv_heads=2, ffn=256, vocab=64)
    types = {"token_embd": Q.Q8_0,
             "blk.0.attn_q": Q.Q4_K, "blk.0.attn_k": Q.Q4_K, "blk.0.attn_v": Q.Q6_K, "blk.0.attn_output": Q.IQ4_XS,
             "blk.0.ffn_gate": Q.Q8_0, "blk.0.ffn_up": Q.Q8_0, "blk.0.ffn_down": Q.Q5_K,
             "blk.1.attn_q": Q.Q4_0, "blk.1.attn_k": Q.F32, "blk.1.attn_v": Q.Q4_0, "blk.1.attn_output": Q.Q2_K,
             "blk.1.ffn_gate": Q.F16, "blk.1.ffn_up": Q.Q5_1, "blk.1.ffn_down": Q.Q3_K}
    tensors = {}
    for name, array in values.items():
        qtype = types.get(name.removesuffix(".weight"), Q.F32)
        tensors[name] = (array if qtype == Q.F32 else _encode(array.astype(np.float16) if qtype == Q.F16 else array,
                                                              qtype, rng), qtype)
    path = _write(tmp_path / "mixed.gguf", "llama", _hparams("llama", hidden=256, ffn=256), tensors)
    ckpt = GGUFCheckpoint(path)

    def build(stream):
        with torch.device("meta"):
            model = resolve_model_class(ckpt.config)(ckpt.config)
        model = model.to_empty(device="cpu")
        model.tie_weights()
        model.load_weights(stream)
        return model

    packed, dense = build(ckpt.weights(torch.float32, keep_packed=True)), build(ckpt.weights(torch.float32))
    layer0, layer1 = packed.model.layers
    assert [s.ggml_type for s in layer0.self_attn.qkv_proj.segments] == [int(Q.Q4_K), int(Q.Q6_K)]
    assert layer1.self_attn.qkv_proj.packed is None and layer1.self_attn.qkv_proj.weight.numel() > 0  # F32 k
    assert packed.lm_head.packed is packed.model.embed_tokens.packed is not None
    ids = torch.tensor([0, 5, 63, 5])
    assert torch.equal(packed.model.embed_tokens(ids), dense.model.embed_tokens(ids))
    dense_modules = dict(dense.named_modules())
    checked = 0
    for name, module in packed.named_modules():
        if isinstance(module, Linear):
            reference = dense_modules[name]
            x = torch.randn(3, reference.weight.shape[1])
            bound = torch.from_numpy(matmul_bound(x.double().numpy(), reference.weight.detach().double().numpy()))
            assert torch.all((module(x) - reference(x)).abs() <= bound), name
            checked += 1
    assert checked == 2 * 4 + 1


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.Q5_0], ids=lambda t: t.name)
def test_bfloat16_slabs(qtype):
    """bf16 activations take bf16 slabs: decoded values rounded as torch rounds them, matmul within bf16 error."""
    rng = np.random.default_rng(7)
    rows, cols = 64, 512
    data = random_blocks(qtype, rows, cols, rng)
    packed = PackedTensor.from_numpy(data, int(qtype), (rows, cols))
    slab = torch.empty(rows, cols, dtype=torch.bfloat16)
    kernels.block_kernels().vq_decode_range_bf16(int(qtype), packed.data.data_ptr(), packed.data.shape[1], cols, 0,
                                                 rows, slab.data_ptr(), 1)
    assert torch.equal(slab, packed.dequantize().to(torch.bfloat16))
    x = torch.randn(SMALL_MAX_ROWS + 8, cols).to(torch.bfloat16)
    y = packed_linear(x, packed)
    assert y.dtype == torch.bfloat16
    reference = x.double() @ packed.dequantize().double().t()
    scale = x.double().abs() @ packed.dequantize().double().abs().t()
    assert torch.all((y.double() - reference).abs() <= 2e-2 * scale)


def _decode_range(qtype: Q, data: np.ndarray, cols: int, first: int, count: int) -> tuple[np.ndarray, torch.Tensor]:
    """Rows first .. first + count through vq_decode_range and vq_decode_range_bf16 (two threads)."""
    lib = kernels.block_kernels()
    data = np.ascontiguousarray(data)
    f32 = np.full((count, cols), np.nan, np.float32)
    bf16 = torch.full((count, cols), float("nan"), dtype=torch.bfloat16)
    lib.vq_decode_range(int(qtype), data.ctypes.data, data.shape[1], cols, first, count, f32.ctypes.data, 2)
    lib.vq_decode_range_bf16(int(qtype), data.ctypes.data, data.shape[1], cols, first, count, bf16.data_ptr(), 2)
    return f32, bf16


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_range_decoders_bit_identical(qtype):
    """The slab decoders (vectorized for the common types) on a row range starting mid-tensor: float32
    bit-identical to gguf.quants.dequantize, bf16 its round-to-nearest-even (as torch rounds)."""
    rng = np.random.default_rng(200 + int(qtype))
    rows, cols, first, count = 37, 768, 5, 29
    data = random_blocks(qtype, rows, cols, rng)
    reference = dequantize(data, qtype).reshape(rows, cols).astype(np.float32)[first:first + count]
    f32, bf16 = _decode_range(qtype, data, cols, first, count)
    assert np.array_equal(f32.view(np.uint32), reference.view(np.uint32)), qtype.name
    assert torch.equal(bf16.view(torch.int16), torch.from_numpy(reference).to(torch.bfloat16).view(torch.int16)), qtype.name


@pytest.mark.parametrize("qtype", [t for t in _HALF_FIELDS], ids=lambda t: t.name)
def test_range_decoders_on_extreme_scales(qtype):
    """fp16 scales at the edges: subnormal, the largest finite, zero, negative, inf and NaN (values NaN where
    the reference's are, every other value bit-identical, in float32 and bf16)."""
    rng = np.random.default_rng(300 + int(qtype))
    rows, cols = 8, 512
    data = random_blocks(qtype, rows, cols, rng)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = data.reshape(-1, size)
    specials = np.array([2.0 ** -24, 6.1e-5, 65504.0, 0.0, -0.0, -0.013, np.inf, -np.inf, np.nan], np.float16)
    for i in range(len(blocks)):
        for offset in _HALF_FIELDS[qtype]:
            blocks[i, offset:offset + 2] = specials[(i + offset) % len(specials):][:1].view(np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        reference = dequantize(data, qtype).reshape(rows, cols).astype(np.float32)[1:]
    f32, bf16 = _decode_range(qtype, data, cols, 1, rows - 1)
    nan = np.isnan(reference)
    assert nan.any() and np.array_equal(np.isnan(f32), nan), qtype.name
    assert np.array_equal(f32[~nan].view(np.uint32), reference[~nan].view(np.uint32)), qtype.name
    expected = torch.from_numpy(reference).to(torch.bfloat16)
    assert torch.equal(bf16.isnan(), torch.from_numpy(nan)), qtype.name
    assert torch.equal(bf16[~torch.from_numpy(nan)].view(torch.int16), expected[~torch.from_numpy(nan)].view(torch.int16))


def _cpu_has_avx512() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " avx512f " in f" {line.split(':')[1].strip()} " for line in f)


@pytest.mark.parametrize("path", ["tiled", "dense"])
@pytest.mark.parametrize("slab_floats", [1 << 22, 24 * 256, 7 * 256])
def test_segments_whole_or_in_power_of_two_slabs(slab_floats, path, monkeypatch):
    """Fused segments of two block types (37 and 21 rows: ragged against every tile) equal the dequantized
    product on each path: the tiled kernel, and without it the weight decoded whole (one matmul) or in slabs
    with a partial last slab per segment (slab rows rounded down to a power of two: 24 -> 16, 7 -> 4), as
    W x^T up to _TRANSPOSED_MAX_ROWS rows, as x W^T above."""
    monkeypatch.setattr(quantized, "_SLAB_FLOATS", slab_floats)
    if path == "dense":
        monkeypatch.setattr(quantized, "_tiled_kernel_built", lambda: False)
    rng = np.random.default_rng(slab_floats)
    cols, parts = 256, [(Q.Q4_K, 37), (Q.Q8_0, 21)]
    segments, dense = [], []
    for qtype, rows in parts:
        data = random_blocks(qtype, rows, cols, rng)
        segments.append(PackedTensor.from_numpy(data, int(qtype), (rows, cols)))
        dense.append(dequantize(data, qtype).reshape(rows, cols).astype(np.float64))
    weight = np.concatenate(dense)
    first_operands = []
    spy = quantized.dense_linear
    monkeypatch.setattr(quantized, "dense_linear", lambda a, b: first_operands.append(a.shape[0]) or spy(a, b))
    tiled = path == "tiled" and _cpu_has_avx512()
    for m in (SMALL_MAX_ROWS + 1, 70, quantized._TRANSPOSED_MAX_ROWS, quantized._TRANSPOSED_MAX_ROWS + 1):
        first_operands.clear()
        x = torch.randn(m, cols)
        got = packed_linear(x, segments).double().numpy()
        assert got.shape == (m, weight.shape[0])
        bound = matmul_bound(x.double().numpy(), weight)
        assert np.all(np.abs(got - x.double().numpy() @ weight.T) <= bound + 1e-30), f"m={m}"
        transposed = m <= quantized._TRANSPOSED_MAX_ROWS
        if tiled and transposed:
            assert first_operands == [], (m, first_operands)  # the C kernel, no dense matmul
        else:
            assert first_operands and all((rows != m) == transposed for rows in first_operands), (m, first_operands)


def test_tiled_kernel_is_built_exactly_where_avx512_is():
    """vq_matmul_tiled computes on AVX-512 CPUs and declines (0, so the slab path runs) elsewhere, as
    vq_matmul_tiled_built says."""
    data = random_blocks(Q.Q8_0, 8, 64, np.random.default_rng(0))
    x, y = torch.randn(16, 64), torch.empty(16, 8)
    done = kernels.block_kernels().vq_matmul_tiled(int(Q.Q8_0), data.ctypes.data, data.shape[1], 8, 64,
                                                  x.data_ptr(), 16, y.data_ptr(), 8, 1)
    assert done == int(_cpu_has_avx512())
    assert kernels.block_kernels().vq_matmul_tiled_built() == int(_cpu_has_avx512())


@pytest.mark.parametrize("n, m, ld, column", [(4096, 64, 5000, 700), (37, 13, 50, 5), (8, 8, 8, 0), (100, 3, 107, 7)])
def test_transpose_into_columns(n, m, ld, column):
    """vq_transpose writes src^T into columns [column, column + n) of every dst row (8 x 8 register tiles
    and the ragged edges) and nothing else."""
    src = torch.randn(n, m)
    dst = torch.full((m, ld), -7.0)
    kernels.block_kernels().vq_transpose(src.data_ptr(), n, m, dst.data_ptr() + 4 * column, ld, 2)
    assert torch.equal(dst[:, column:column + n], src.t())
    assert (dst[:, :column] == -7.0).all() and (dst[:, column + n:] == -7.0).all()


def _small_batch_check(lib, qtype: Q, rng: np.random.Generator) -> None:
    """vq_matmul_small on ragged shapes (37 weight rows against 16- and 8-lane panels, 13 activation rows
    against 8- and 4-row register tiles) writes its columns of a wider y within SMALL_RTOL, nothing else."""
    n, k, column, ld = 37, 512, 5, 50
    data = random_blocks(qtype, n, k, rng)
    weight = dequantize(data, qtype).reshape(n, k).astype(np.float64)
    for m in (SMALL_MIN_ROWS, 13, SMALL_MAX_ROWS):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[1] *= 1e-20  # a row scale far from 1
        y = np.full((m, ld), -7.0, np.float32)
        assert lib.vq_matmul_small(int(qtype), data.ctypes.data, data.shape[1], n, k, x.ctypes.data, m,
                                   y.ctypes.data + 4 * column, ld, 2) == 1
        expected = x.astype(np.float64) @ weight.T
        bound = matmul_bound(x.astype(np.float64), weight, small=True)
        assert np.all(np.abs(y[:, column:column + n] - expected) <= bound), (qtype.name, m)
        assert (y[:, :column] == -7.0).all() and (y[:, column + n:] == -7.0).all()


@pytest.mark.parametrize("qtype", sorted(SMALL_TYPES), ids=lambda t: t.name)
def test_small_batch_kernel(qtype):
    _small_batch_check(kernels.block_kernels(), qtype, np.random.default_rng(400 + int(qtype)))


def test_small_batch_kernel_declines_what_it_lacks():
    """0 (the caller takes the few-row or tiled kernel) for block types without integer panels and past 32 rows."""
    lib = kernels.block_kernels()
    x, y = torch.randn(33, 256), torch.empty(33, 8)
    for qtype, m in ((Q.Q2_K, 8), (Q.F16, 8), (Q.IQ4_XS, 8), (Q.Q8_0, 33)):
        data = random_blocks(qtype, 8, 256, np.random.default_rng(0))
        assert lib.vq_matmul_small(int(qtype), data.ctypes.data, data.shape[1], 8, 256, x.data_ptr(), m,
                                   y.data_ptr(), 8, 1) == 0, qtype.name


def _cpu_has(flag: str) -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and f" {flag} " in f" {line.split(':')[1].strip()} " for line in f)


def _variant_library(flags: list[str]):
    """ggml_blocks.c built with -march=native plus `flags`, as a CPU without those features builds it: cached
    beside the native library, keyed by source and flags like it."""
    import ctypes
    import hashlib
    import shutil

    from vllmpy.loader.default_model import cache_dir

    source = kernels.Path(kernels.__file__).with_name("ggml_blocks.c")
    all_flags = kernels._FLAGS + kernels._NATIVE + flags
    compiler = shutil.which("cc") or shutil.which("gcc")
    parts = [kernels._source_text(source), compiler, *all_flags, kernels._cpu_signature()]
    key = hashlib.sha256("\0".join(parts).encode())
    target = cache_dir() / "kernels" / f"ggml_blocks-test-{key.hexdigest()[:16]}.so"
    if not target.exists():
        kernels._compile(compiler, all_flags, source, target)
    return kernels._bind_blocks(ctypes.CDLL(str(target)))


@pytest.mark.skipif(not _cpu_has("avx2"), reason="the AVX2 builds need an AVX2 CPU")
@pytest.mark.parametrize("flags", [["-mno-avx512f"], ["-mno-avx512f", "-mno-avxvnni"]], ids=["avx2", "avx2-no-vnni"])
def test_small_batch_kernel_in_avx2_builds(flags):
    """The 8-lane AVX2 panels (vpdpwssd with AVX-VNNI, pmaddwd without), built as an AVX2 CPU builds them."""
    lib = _variant_library(flags)
    assert not lib.vq_matmul_tiled_built()  # really a build without AVX-512
    rng = np.random.default_rng(500)
    for qtype in (Q.Q4_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.Q4_K, Q.Q5_K, Q.Q6_K):
        _small_batch_check(lib, qtype, rng)


# The row dots' builds: this CPU's, AVX2 with and without AVX-VNNI, AVX-512 without BITALG's vpshufbitqmb and VNNI
# (Skylake-X's set); each needs its base ISA here.
ROW_DOT_BUILDS = {"native": ([], None), "avx2": (["-mno-avx512f"], "avx2"),
                  "avx2-no-vnni": (["-mno-avx512f", "-mno-avxvnni"], "avx2"),
                  "avx512-no-bitalg-vnni": (["-mno-avx512bitalg", "-mno-avx512vnni"], "avx512bw")}


@pytest.mark.parametrize("build", list(ROW_DOT_BUILDS))
def test_row_dots_on_ragged_shapes(build):
    """The few-row kernel (groups of 4 blocks, two weight rows at a time for one activation row) where rows and
    groups end mid-way: 37 weight rows split over 1 and 2 threads, 13 blocks of 32 (the last group 1 block;
    K-quants 3 super-blocks), 1-3 activation rows, ordinary and adversarial x; within matmul_bound of float64."""
    flags, needs = ROW_DOT_BUILDS[build]
    if needs and not _cpu_has(needs):
        pytest.skip(f"the {build} build needs {needs}")
    from tests.gguf.test_mxfp4 import mxfp4_blocks

    lib = kernels.block_kernels() if not flags else _variant_library(flags)
    rng = np.random.default_rng(600)
    n = 37
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.MXFP4, Q.Q4_K, Q.Q5_K, Q.Q6_K):
        k = 768 if GGML_QUANT_SIZES[qtype][0] == 256 else 416
        data = mxfp4_blocks(rng, n, k, (110, 135)) if qtype == Q.MXFP4 else random_blocks(qtype, n, k, rng)
        weight = dequantize(data, qtype).reshape(n, k).astype(np.float64)
        x = np.concatenate([rng.standard_normal((3, k)).astype(np.float32), adversarial_x(k, rng)])
        expected, bound = x.astype(np.float64) @ weight.T, matmul_bound(x.astype(np.float64), weight)
        for m in (1, 2, 3):
            for threads in (1, 2):
                y = np.full((len(x), n), np.nan, np.float32)
                for i in range(0, len(x) - m + 1, m):
                    lib.vq_matmul(int(qtype), data.ctypes.data, data.shape[1], n, k, x[i:].ctypes.data, m,
                                  y[i:].ctypes.data, n, threads)
                done = len(x) // m * m
                err = np.abs(y[:done] - expected[:done])
                assert np.all(err <= bound[:done] + 2.0 ** -149), (build, qtype.name, m, threads)
