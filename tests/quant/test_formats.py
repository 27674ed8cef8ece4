"""Each format's tensors, in its on-disk layout, repack into blocks whose decoded values are bit-identical
to the format's reference dequantization (tests/quant/reference.py), and the packed matmul agrees with
the dense one on those values within float32 accumulation error."""
from __future__ import annotations

import pytest
import torch

from tests.quant import reference as ref
from vllmpy.layers.quantized import packed_linear
from vllmpy.loader.quantization.blocks import F8S, Q4_0, Q4Z, Q4Z128, Q4ZF, Q8_0, Q8Z, Q8ZF
from vllmpy.loader.quantization.config import AWQ, FP8, GPTQ, NAIVE_INT, PACKED, Scheme
from vllmpy.loader.quantization.formats import read_module

OUT, IN = 96, 256


def _codes(bits: int, groups: int, sym: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (OUT, IN), generator=g, dtype=torch.int32)
    center = 1 << (bits - 1)
    zeros = (torch.full((OUT, groups), center, dtype=torch.int32) if sym
             else torch.randint(0, 1 << bits, (OUT, groups), generator=g, dtype=torch.int32))
    scales = (torch.rand(OUT, groups, generator=g) * 0.02 + 1e-3).half()
    return q, zeros, scales


def _read(tensors: dict[str, torch.Tensor], scheme: Scheme):
    named = {f"m.{k}": v for k, v in tensors.items()}
    return read_module("m", scheme, named.__getitem__, named.__contains__)


def _int_type(bits: int, group: int, sym: bool) -> int:
    """The block an integer case repacks into (fp16 scales): 4-bit zero points in groups of a multiple of 128
    take Q4Z128."""
    if sym:
        return Q4_0 if bits == 4 else Q8_0
    if bits == 4:
        return Q4Z128 if (IN if group == -1 else group) % 128 == 0 else Q4Z
    return Q8Z


def _check(packed, expected: torch.Tensor, ggml_type: int) -> None:
    assert packed.ggml_type == ggml_type
    got = packed.dequantize()
    assert torch.equal(got.view(torch.int32), expected.float().view(torch.int32))  # bit-identical
    for rows in (1, 7, 40):  # block kernel, tiled / slab paths
        x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
        y, dense = packed_linear(x, packed), x.double() @ expected.double().t()
        bound = 1e-5 * (x.abs().double() @ expected.abs().double().t()).max() + 1e-6
        assert float((y.double() - dense).abs().max()) <= bound


@pytest.mark.parametrize("bits,group,sym,v1", [(4, 32, True, True), (4, 128, False, True), (4, -1, False, False),
                                               (8, 64, True, True), (8, -1, False, True)])
def test_gptq(bits, group, sym, v1):
    groups = 1 if group == -1 else IN // group
    q, zeros, scales = _codes(bits, groups, sym)
    if v1 and not sym:
        zeros[0, 0] = 0  # stored as 2^bits - 1: v1's "+ 1" makes the zero 2^bits (Q4Z / Q8Z hold it)
    tensors = ref.gptq_tensors(q, zeros, scales, bits, None, v1)
    expected = ref.gptq_dequantize(tensors, bits, v1)
    scheme = Scheme(GPTQ, bits=bits, group_size=group, symmetric=sym, gptq_v1_zeros=v1)
    _check(_read(tensors, scheme), expected, _int_type(bits, group, sym))


@pytest.mark.parametrize("group", [64, 128])
def test_gptq_act_order_permutes_columns(group):
    """desc_act: g_idx assigns columns to groups out of order; the repack sorts columns by group and the
    matmul permutes the activation the same way."""
    q, zeros, scales = _codes(4, IN // group, False)
    perm = torch.randperm(IN, generator=torch.Generator().manual_seed(1))
    g_idx = torch.empty(IN, dtype=torch.int64)
    g_idx[perm] = torch.arange(IN) // group
    tensors = ref.gptq_tensors(q, zeros, scales, 4, g_idx, v1=True)
    packed = _read(tensors, Scheme(GPTQ, bits=4, group_size=group, symmetric=False, gptq_v1_zeros=True))
    assert packed.input_perm is not None
    _check(packed, ref.gptq_dequantize(tensors, 4, v1=True), _int_type(4, group, False))


@pytest.mark.parametrize("group", [32, 128, -1])
def test_awq(group):
    q, zeros, scales = _codes(4, 1 if group == -1 else IN // group, False)
    tensors = ref.awq_tensors(q, zeros, scales)
    _check(_read(tensors, Scheme(AWQ, bits=4, group_size=group, symmetric=False)), ref.awq_dequantize(tensors),
           _int_type(4, group, False))


@pytest.mark.parametrize("bits,group,sym", [(4, 32, True), (4, 128, False), (4, -1, True), (8, 64, False),
                                            (8, -1, True)])
def test_compressed_tensors_pack_quantized(bits, group, sym):
    q, zeros, scales = _codes(bits, 1 if group == -1 else IN // group, sym)
    tensors = ref.ct_packed_tensors(q, zeros, scales.bfloat16() if sym else scales, bits, sym)
    scheme = Scheme(PACKED, bits=bits, group_size=group, symmetric=sym)
    _check(_read(tensors, scheme), ref.ct_int_dequantize(tensors, bits), _int_type(bits, group, sym))


@pytest.mark.parametrize("bits,sym,group,ggml_type", [(8, True, 32, Q8ZF), (4, False, 32, Q4ZF),
                                                      (4, False, 128, Q4ZF)])
def test_fp32_scales_that_fp16_cannot_hold_keep_float32_blocks(bits, sym, group, ggml_type):
    """A scale fp16 rounds (fp32 from llm-compressor) cannot go in Q8_0, Q4Z or Q4Z128: Q8ZF / Q4ZF hold it
    exactly."""
    q, zeros, scales = _codes(bits, IN // group, sym)
    tensors = ref.ct_packed_tensors(q, zeros, scales.float() * (1 + 2 ** -20), bits, sym)
    _check(_read(tensors, Scheme(PACKED, bits=bits, group_size=group, symmetric=sym)),
           ref.ct_int_dequantize(tensors, bits), ggml_type)


def test_compressed_tensors_int_quantized_w8a8():
    q, _, scales = _codes(8, 1, True)
    tensors = {"weight": (q - 128).to(torch.int8), "weight_scale": scales.float(),
               "input_scale": torch.tensor([0.1])}
    expected = scales.float() * (q - 128).float()
    _check(_read(tensors, Scheme(NAIVE_INT, bits=8, symmetric=True)), expected, Q8_0)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_fp8(strategy):
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(2))
    codes, scale = ref.fp8_quantize(w, strategy)
    block = (128, 128) if strategy == "block" else None
    name = "weight_scale_inv" if block else "weight_scale"
    tensors = {"weight": codes, name: scale, "input_scale": torch.tensor(0.5)}
    _check(_read(tensors, Scheme(FP8, block=block)), ref.fp8_dequantize(codes, scale, block), F8S)


def test_fp8_every_code_decodes_as_torch_does():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).repeat(OUT, 1)
    codes[:, 0x7F] = codes[:, 0xFF] = 0  # the NaN codes
    scale = torch.tensor([0.75])
    _check(_read({"weight": codes, "weight_scale": scale}, Scheme(FP8)),
           ref.fp8_dequantize(codes, scale), F8S)
