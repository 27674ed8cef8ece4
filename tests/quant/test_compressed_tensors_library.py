"""compressed-tensors checkpoints written by the `compressed-tensors` package's own compressors decode to
exactly what its decompressor returns: with float32 scales bit for bit; with the file's fp16 scales its
decompressor rounds the (exact) product to fp16, which is our value rounded to fp16."""
from __future__ import annotations

import pytest
import torch

from vllmpy.loader.quantization.config import FP8, NAIVE_INT, PACKED, Scheme
from vllmpy.loader.quantization.formats import read_module

ct = pytest.importorskip("compressed_tensors")  # the spec-written references (test_formats.py) always run
from compressed_tensors.compressors.naive_quantized.base import (  # noqa: E402
    FloatQuantizationCompressor,
    IntQuantizationCompressor,
)
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402

OUT, IN = 64, 256


def _scale_zero(w: torch.Tensor, bits: int, group: int, sym: bool):
    g = w.reshape(OUT, -1, group)
    top = (1 << bits) - 1
    if sym:
        return (g.abs().amax(-1) / (top // 2)).half(), None
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / top).half()
    return scale, (torch.round(-lo / scale.float()) - (1 << (bits - 1))).clamp(-(1 << (bits - 1)), top // 2).to(torch.int8)


def _decode(state: dict[str, torch.Tensor], scheme: Scheme) -> torch.Tensor:
    named = {f"m.{k}": v for k, v in state.items()}
    return read_module("m", scheme, named.__getitem__, named.__contains__).dequantize()


def _library_values(compressor, state: dict[str, torch.Tensor], args: QuantizationArgs) -> tuple[torch.Tensor, ...]:
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    exact = compressor.decompress({**state, "weight_scale": state["weight_scale"].float()}, scheme)["weight"]
    return exact, compressor.decompress(state, scheme)["weight"]


@pytest.mark.parametrize("bits,strategy,sym", [(4, "group", True), (4, "group", False), (4, "channel", False),
                                               (8, "group", False), (8, "channel", True)])
def test_pack_quantized_matches_decompressor(bits, strategy, sym):
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(bits))
    group = 64 if strategy == "group" else IN
    scale, zero = _scale_zero(w, bits, group, sym)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy=strategy,
                            group_size=group if strategy == "group" else None)
    state = {"weight": w.half(), "weight_scale": scale}
    if zero is not None:
        state["weight_zero_point"] = zero
    state = PackedQuantizationCompressor.compress(state, QuantizationScheme(targets=["Linear"], weights=args))
    ours = _decode(state, Scheme(PACKED, bits=bits, group_size=group if strategy == "group" else -1, symmetric=sym))
    exact, native = _library_values(PackedQuantizationCompressor, state, args)
    assert torch.equal(ours, exact)
    assert torch.equal(ours.half(), native)


def test_int_quantized_matches_decompressor():
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(3))
    scale, _ = _scale_zero(w, 8, IN, True)
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    state = IntQuantizationCompressor.compress({"weight": w.half(), "weight_scale": scale},
                                               QuantizationScheme(targets=["Linear"], weights=args))
    exact, _ = _library_values(IntQuantizationCompressor, state, args)
    assert torch.equal(_decode(state, Scheme(NAIVE_INT, bits=8, symmetric=True)), exact)


def test_float_quantized_fp8_matches_decompressor():
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(4))
    scale = (w.abs().amax(1, keepdim=True) / 448).float()
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
    state = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale},
                                                 QuantizationScheme(targets=["Linear"], weights=args))
    assert state["weight"].dtype == torch.float8_e4m3fn
    exact, _ = _library_values(FloatQuantizationCompressor, state, args)
    assert torch.equal(_decode(state, Scheme(FP8)), exact)
