"""MLA's absorbed up-projections on packed blocks: vq_matmul_heads (y[h] = x[h] W[h]^T for every head in one call)
within the packed matmuls' bound of float64 on the decoded blocks, in the native, AVX2 and portable builds
(row dots, and decode + float for the types without them), on strided rows; and kv_b_proj's packed k_b / v_b
(llama.cpp's split, `to_packed`'s head stacks) or whole kv_b wired into W_UK / W_UV as the float views are."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from vllmpy.attention.mla import KVUpProjection, MLAAttention
from vllmpy.layers.quantized import PackedTensor
from tests.gguf.test_mxfp4 import lib  # noqa: F401 (the builds' fixture)
from tests.gguf.test_packed_kernels import matmul_bound, random_blocks

HEADS, N, K = 3, 19, 256
LORA, NOPE, V = 64, 32, 32


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q2_K, Q.F16], ids=lambda t: t.name)
def test_heads_kernel_matches_the_dequantized_blocks(lib, qtype):  # noqa: F811 (the fixture)
    """Strided x and y (a wider buffer, as q_abs's latent half), heads apart by more than their rows (whole kv_b's
    V rows); 70 rows pass the portable path's 64-row chunks. Nothing outside each head's n columns is written."""
    rng = np.random.default_rng(int(qtype))
    stride, first = N + 5, 2
    data = random_blocks(qtype, HEADS * stride, K, rng)
    weight = dequantize(data, qtype).reshape(HEADS, stride, K)[:, first:first + N].astype(np.float64)
    for m in (1, 5, 70):
        x = rng.standard_normal((m, HEADS, K + 8)).astype(np.float32)
        x[0, 1] *= 1e-20  # a head's row far from the others' scale
        y = np.full((m, HEADS, N + 3), -7.0, np.float32)
        assert lib.vq_matmul_heads(int(qtype), data.ctypes.data + first * data.shape[1], stride * data.shape[1],
                                   data.shape[1], HEADS, N, K, x.ctypes.data, K + 8, HEADS * (K + 8), m, y.ctypes.data,
                                   N + 3, HEADS * (N + 3), 2) == 1
        for h in range(HEADS):
            xh = x[:, h, :K].astype(np.float64)
            bound = matmul_bound(xh, weight[h])
            assert np.all(np.abs(y[:, h, :N] - xh @ weight[h].T) <= bound + 1e-30), (qtype.name, m, h)
        assert (y[:, :, N:] == -7.0).all()


def _packed(values: np.ndarray) -> PackedTensor:
    """A [heads, rows, cols] float array as Q8_0 blocks, one [heads * rows, cols] matrix (`to_packed`'s head stack)."""
    rows = values.reshape(-1, values.shape[-1])
    return PackedTensor.from_numpy(quantize(rows, Q.Q8_0), int(Q.Q8_0), rows.shape)


def _check_products(layer: MLAAttention, uk: bool) -> None:
    """The packed products equal the float views' (which hold the same blocks decoded) within the float bound."""
    x, lat = torch.randn(4, HEADS, NOPE), torch.randn(4, HEADS, LORA)
    products = [(layer.uv_blocks, lat, torch.bmm(lat.transpose(0, 1), layer.w_uv_t).transpose(0, 1))]
    if uk:
        products.append((layer.uk_blocks, x, torch.bmm(x.transpose(0, 1), layer.w_uk).transpose(0, 1)))
    else:
        assert layer.uk_blocks is None  # whole kv_b's K rows run along kv_lora_rank: W_UK stays float
    for blocks, inputs, expected in products:
        out = torch.empty_like(expected)
        assert blocks.matmul(inputs, out)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-4)


def test_split_halves_stay_packed_and_fill_the_float_weight():
    rng = np.random.default_rng(0)
    k_b = rng.standard_normal((HEADS, LORA, NOPE)).astype(np.float32)  # llama.cpp's transposed K half
    v_b = rng.standard_normal((HEADS, V, LORA)).astype(np.float32)
    kv_b = KVUpProjection(LORA, HEADS, NOPE, V)
    kv_b.load_packed(_packed(k_b), "k_b")
    kv_b.load_packed(_packed(v_b), "v_b")
    layer = MLAAttention(HEADS, LORA, NOPE, 8, V, scale=1.0)
    layer.absorb(kv_b.weight.data)  # prefill's weight: both halves decoded into every head's rows
    layer.uk_blocks, layer.uv_blocks = kv_b.head_blocks()
    _check_products(layer, uk=True)


def test_whole_kv_b_packs_only_the_value_product():
    rng = np.random.default_rng(1)
    whole = rng.standard_normal((HEADS, NOPE + V, LORA)).astype(np.float32)
    kv_b = KVUpProjection(LORA, HEADS, NOPE, V)
    kv_b.load_packed(_packed(whole))
    layer = MLAAttention(HEADS, LORA, NOPE, 8, V, scale=1.0)
    layer.absorb(kv_b.packed.dequantize())
    layer.uk_blocks, layer.uv_blocks = kv_b.head_blocks()
    _check_products(layer, uk=False)
