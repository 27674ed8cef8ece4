"""Read one quantized module's tensors in its format's on-disk layout into blocks (blocks.py).

Layouts (w[o, i] = scale * (q - zero), codes unsigned in [0, 2^bits)):
- GPTQ: qweight int32 [in * bits / 32, out] packed along the input (value i at bits (i % per_word) * bits),
  qzeros int32 [groups, out * bits / 32] packed along the output, scales [groups, out], g_idx [in] (group of
  each input column; act-order when not i // group_size). checkpoint_format "gptq" stores zero - 1.
- AWQ (GEMM): qweight int32 [in, out / 8] and qzeros [groups, out / 8] packed along the output with the
  interleaved nibble order 0 2 4 6 1 3 5 7; scales [groups, out].
- compressed-tensors pack-quantized: weight_packed int32 [out, in * bits / 32] (32 values in `bits` words,
  offset by 2^(bits-1)), weight_scale [out, groups], weight_zero_point int32 packed along the output
  (asymmetric), weight_shape, weight_g_idx (act-order).
- compressed-tensors int-quantized: weight int8 [out, in], weight_scale, weight_zero_point int8.
- fp8 / compressed-tensors float-quantized: weight float8_e4m3fn [out, in], weight_scale (or block-wise
  weight_scale_inv); input_scale (static activations) is read and not applied: activations stay float.
- mxfp4 (gpt-oss): an MoE layer's `<experts>.<proj>_blocks` / `_scales` expert stacks (mxfp4.py).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.quantized import PackedTensor
from vllmpy.loader.quantization.blocks import IntWeight, pack_fp8, pack_int
from vllmpy.loader.quantization import mxfp4
from vllmpy.loader.quantization.config import AWQ, FP8, GPTQ, MXFP4, NAIVE_INT, PACKED, Scheme

Getter = Callable[[str], torch.Tensor]
Read = TypeVar("Read")
# AWQ's nibble n of a word holds output column _AWQ_ORDER[n]; column c sits in nibble _AWQ_REVERSE[c].
_AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]
# The tensors each layout stores for a module, beside the primary one (first).
COMPONENTS = {
    GPTQ: ("qweight", "qzeros", "scales", "g_idx"),
    AWQ: ("qweight", "qzeros", "scales"),
    PACKED: ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
    NAIVE_INT: ("weight", "weight_scale", "weight_zero_point", "weight_g_idx", "input_scale", "input_zero_point"),
    FP8: ("weight", "weight_scale", "weight_scale_inv", "input_scale"),
    MXFP4: mxfp4.COMPONENTS,
}


def unpack_last(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 words -> their `bits`-wide little-endian fields along the last dim (first `count`), as uint8."""
    raw = words.contiguous().view(torch.uint8).reshape(*words.shape[:-1], -1)
    if bits == 8:
        fields = raw
    else:
        fields = torch.stack([raw & 0xF, raw >> 4], dim=-1).reshape(*raw.shape[:-1], -1)
    return fields[..., :count]


def _act_order(name: str, g_idx: torch.Tensor | None, groups: int) -> torch.Tensor | None:
    """The input columns sorted by group (None when already in order); each group must be equally sized."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    columns = g_idx.numel()
    if columns % groups or not torch.equal(torch.bincount(g_idx, minlength=groups),
                                           torch.full((groups,), columns // groups)):
        raise UnsupportedCheckpointError(f"tensor {name!r}: g_idx groups are not all {columns // groups} columns")
    if torch.equal(g_idx, torch.arange(columns) // (columns // groups)):
        return None
    return torch.argsort(g_idx, stable=True)


def _check_groups(name: str, scheme: Scheme, columns: int, groups: int) -> None:
    """The scales' group count must be the config's group_size: a mismatch means a misread layout."""
    expected = 1 if scheme.group_size == -1 else -(-columns // scheme.group_size)
    if groups != expected:
        raise UnsupportedCheckpointError(
            f"tensor {name!r} has {groups} groups for {columns} input columns, but quantization_config "
            f"group_size={scheme.group_size} means {expected}")


def _ordered(q: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    return q if perm is None else q.index_select(1, perm)


def _gptq(module: str, scheme: Scheme, get: Getter, has: Callable[[str], bool]) -> PackedTensor:
    qweight, scales = get(f"{module}.qweight"), get(f"{module}.scales")
    groups, out = scales.shape
    columns = qweight.shape[0] * 32 // scheme.bits
    _check_groups(f"{module}.scales", scheme, columns, groups)
    q = unpack_last(qweight.t(), scheme.bits, columns)
    zeros = unpack_last(get(f"{module}.qzeros"), scheme.bits, out).t().to(torch.int16)
    if scheme.gptq_v1_zeros:
        zeros = zeros + 1
    g_idx = get(f"{module}.g_idx") if has(f"{module}.g_idx") else None
    perm = _act_order(f"{module}.g_idx", g_idx, groups)
    return pack_int(IntWeight(f"{module}.qweight", _ordered(q, perm), zeros.contiguous(), scales.t(), scheme.bits, perm))


def _awq(module: str, scheme: Scheme, get: Getter, has: Callable[[str], bool]) -> PackedTensor:
    qweight, qzeros, scales = get(f"{module}.qweight"), get(f"{module}.qzeros"), get(f"{module}.scales")
    _check_groups(f"{module}.scales", scheme, qweight.shape[0], scales.shape[0])

    def columns(words: torch.Tensor) -> torch.Tensor:  # [rows, out / 8] -> [rows, out] in column order
        nibbles = unpack_last(words, 4, words.shape[1] * 8)
        return nibbles.reshape(words.shape[0], -1, 8)[..., _AWQ_REVERSE].reshape(words.shape[0], -1)

    return pack_int(IntWeight(f"{module}.qweight", columns(qweight).t().contiguous(), columns(qzeros).t().contiguous(),
                              scales.t(), 4))


def _compressed(module: str, scheme: Scheme, get: Getter, has: Callable[[str], bool]) -> PackedTensor:
    scale = get(f"{module}.weight_scale")
    center = 1 << (scheme.bits - 1)
    if scheme.layout == PACKED:
        out, columns = (int(v) for v in get(f"{module}.weight_shape").tolist())
        q = unpack_last(get(f"{module}.weight_packed"), scheme.bits, columns)
    else:
        weight = get(f"{module}.weight")
        out, columns = weight.shape
        q = (weight.to(torch.int16) + center).to(torch.uint8)
    scale = scale.reshape(out, -1) if scale.numel() != 1 else scale.reshape(1, 1).expand(out, 1)
    _check_groups(f"{module}.weight_scale", scheme, columns, scale.shape[1])
    if scheme.symmetric:
        zeros = torch.full(scale.shape, center, dtype=torch.int16)
    elif scheme.layout == PACKED:
        zeros = unpack_last(get(f"{module}.weight_zero_point").t(), scheme.bits, out).t()
    else:
        zeros = get(f"{module}.weight_zero_point").to(torch.int16).reshape(scale.shape) + center
    g_idx = get(f"{module}.weight_g_idx") if has(f"{module}.weight_g_idx") else None
    perm = _act_order(f"{module}.weight_g_idx", g_idx, scale.shape[1])
    return pack_int(IntWeight(f"{module}.weight", _ordered(q, perm), zeros.contiguous(), scale, scheme.bits, perm))


def _fp8(module: str, scheme: Scheme, get: Getter, has: Callable[[str], bool]) -> PackedTensor:
    weight = get(f"{module}.weight")
    if weight.dtype != torch.float8_e4m3fn:
        raise UnsupportedCheckpointError(f"tensor {module}.weight has dtype {weight.dtype}; supported: float8_e4m3fn")
    name = f"{module}.weight_scale_inv" if has(f"{module}.weight_scale_inv") else f"{module}.weight_scale"
    return pack_fp8(f"{module}.weight", weight.view(torch.uint8), get(name), scheme.block)


READERS = {GPTQ: _gptq, AWQ: _awq, PACKED: _compressed, NAIVE_INT: _compressed, FP8: _fp8}


def read_module(module: str, scheme: Scheme, get: Getter, has: Callable[[str], bool]) -> PackedTensor:
    """The module's weight as blocks; a missing tensor is refused by name."""
    return _guarded(module, scheme, has, lambda: READERS[scheme.layout](module, scheme, get, has))


def read_parts(module: str, scheme: Scheme, get: Getter,
               has: Callable[[str], bool]) -> list[tuple[str, PackedTensor]]:
    """The module's packed weights under their checkpoint names: `<module>.weight`, or (MXFP4) each expert's
    projections of an MoE layer."""
    if scheme.layout == MXFP4:
        return _guarded(module, scheme, has, lambda: mxfp4.read_experts(module, get))
    return [(f"{module}.weight", read_module(module, scheme, get, has))]


def _guarded(module: str, scheme: Scheme, has: Callable[[str], bool], read: Callable[[], Read]) -> Read:
    """read(), with a missing tensor refused by name."""
    primary = f"{module}.{COMPONENTS[scheme.layout][0]}"
    if not has(primary):
        raise UnsupportedCheckpointError(
            f"module {module!r} is quantized by the config ({scheme.layout}) but the checkpoint has no {primary!r}")
    try:
        return read()
    except KeyError as exc:
        raise UnsupportedCheckpointError(f"module {module!r} ({scheme.layout}): missing tensor {exc}") from None
