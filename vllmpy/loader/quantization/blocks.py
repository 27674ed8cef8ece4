"""Repack a quantized weight, exactly, into the blocks that the CPU block kernels compute on.

Integer weights w = scale * (q - zero) in groups of a multiple of 32 input columns become blocks of 32
values (128 for Q4Z128), the group's scale and zero repeated in each of its blocks:
- symmetric 4-bit (zero 8) with fp16-exact scales: GGML Q4_0 (fp16 d, value d * (nibble - 8));
- symmetric 8-bit (zero 128) with fp16-exact scales: GGML Q8_0 (fp16 d, int8 value d * q);
- other 4-bit ones with fp16-exact scales in groups of a multiple of 128 (GPTQ / AWQ / compressed-tensors'
  usual 128, or per channel): Q4Z128 (kernels/ggml_blocks.c), the fp16 scale and an integer zero per 128
  values (67 bytes, ~1.01x the checkpoint's own bytes; Q4Z's 19 per 32 would be 1.14x);
- otherwise Q4Z / Q8Z: the fp16 scale and an integer zero per block (19 / 36 bytes), or Q4ZF / Q8ZF with a
  float32 scale where fp16 would round the checkpoint's (fp32 / bf16 subnormal) scales.
  Q4_1's d * q + m cannot hold these exactly: m = -scale * zero needs more bits than its fp16 has.
fp8 e4m3 weights keep their bytes in F8S blocks with a float32 scale (per tensor, row or [rows, cols]
block, repeated per 32 columns). Every block type decodes with the one float32 product the format's own
dequantization takes, so the decoded values are bit-identical to it.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.quantized import PackedTensor

Q4_0, Q8_0, Q4Z, Q8Z, F8S, Q4ZF, Q8ZF, Q4Z128 = 2, 8, 200, 201, 202, 203, 204, 205
BLOCK, WIDE_BLOCK = 32, 128  # values per block: every type's, Q4Z128's
_SLAB_VALUES = 1 << 20  # codes repacked at once


@dataclass
class IntWeight:
    """[out, in] unsigned codes q (uint8) in [0, 2^bits), zeros and scales [out, groups]: w = scale * (q - zero).
    `perm` (GPTQ act-order): the input columns in group order, so w[:, perm] has contiguous groups."""

    name: str
    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    bits: int
    perm: torch.Tensor | None = None


def _group_size(name: str, columns: int, groups: int) -> int:
    if columns % BLOCK or columns % groups or (columns // groups) % BLOCK:
        raise UnsupportedCheckpointError(
            f"tensor {name!r}: {columns} input columns in {groups} groups; the packed blocks need groups "
            f"of a multiple of {BLOCK} columns")
    return columns // groups


def _block_values(values: torch.Tensor, group: int, block: int) -> torch.Tensor:
    """[out, groups] per-group values repeated for each `block`-column block of its group."""
    return values.repeat_interleave(group // block, dim=1)


def _fp16_exact(scales: torch.Tensor) -> bool:
    return bool(torch.equal(scales.to(torch.float16).float(), scales.float()))


def _bytes(t: torch.Tensor, out: int, nb: int) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(out, nb, -1)


def _block_type(bits: int, half: bool, native: bool, group: int) -> int:
    """native: symmetric with fp16-exact scales. Q4Z128 wherever its one scale and zero per 128 values hold the
    groups exactly."""
    if native:
        return Q4_0 if bits == 4 else Q8_0
    if bits == 4 and half and group % WIDE_BLOCK == 0:
        return Q4Z128
    return {(4, True): Q4Z, (8, True): Q8Z, (4, False): Q4ZF, (8, False): Q8ZF}[(bits, half)]


def pack_int(weight: IntWeight) -> PackedTensor:
    """The weight's blocks, built a slab of rows at a time: the int16 temporaries of a whole large weight
    would add to the load's peak RSS."""
    out, columns = weight.q.shape
    group = _group_size(weight.name, columns, weight.scales.shape[1])
    scales, zeros = weight.scales.float(), weight.zeros.to(torch.int16)
    half = _fp16_exact(scales)
    ggml_type = _block_type(weight.bits, half, half and bool((zeros == 1 << (weight.bits - 1)).all()), group)
    block = WIDE_BLOCK if ggml_type == Q4Z128 else BLOCK
    scales, zeros = _block_values(scales, group, block), _block_values(zeros, group, block)
    step, data = max(1, _SLAB_VALUES // columns), None
    for r in range(0, out, step):
        blocks = _int_rows(weight.q[r:r + step], scales[r:r + step], zeros[r:r + step], weight.bits, ggml_type)
        data = mapped(out, blocks.shape[1]) if data is None else data
        data[r:r + step] = blocks
    return PackedTensor(data, ggml_type, (out, columns), input_perm=weight.perm)


def mapped(rows: int, row_bytes: int) -> torch.Tensor:
    """uint8 [rows, row_bytes] in its own anonymous mapping, which is unmapped when the tensor dies: a weight
    kept packed outside the heap leaves no hole there when fusing q/k/v or gate/up frees it (such holes
    raised a GPTQ load's peak RSS by a third)."""
    buffer = mmap.mmap(-1, max(1, rows * row_bytes))
    return torch.frombuffer(buffer, dtype=torch.uint8, count=rows * row_bytes).view(rows, row_bytes)


def _int_rows(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, ggml_type: int) -> torch.Tensor:
    """Blocks [rows, bytes per row] of `ggml_type` for rows of codes q with per-block scales and zeros."""
    out, nb = scales.shape
    if ggml_type == Q4Z128:  # Q4_K's nibble order: byte 32 h + l holds values 64 h + l and 64 h + 32 + l
        q = q.reshape(out, nb, 2, 2, BLOCK)
        codes = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(out, nb, 2 * BLOCK)
    elif bits == 4:
        q = q.reshape(out, nb, BLOCK)
        codes = q[..., :16] | (q[..., 16:] << 4)
    else:
        center = 1 << (bits - 1)
        codes = (q.reshape(out, nb, BLOCK).to(torch.int16) - center).to(torch.int8).view(torch.uint8)
        zeros = zeros - center
    half = ggml_type not in (Q4ZF, Q8ZF)
    head = [_bytes(scales.half() if half else scales, out, nb)]
    if ggml_type not in (Q4_0, Q8_0):  # the zero: u8 for 4 bits, i16 for 8; the float32 scale's types pad to 8
        head.append(zeros.to(torch.uint8).unsqueeze(2) if bits == 4 else _bytes(zeros, out, nb))
        if not half:
            head.append(torch.zeros(out, nb, 8 - 4 - head[1].shape[2], dtype=torch.uint8))
    return torch.cat([*head, codes], dim=2).reshape(out, -1)


def pack_fp8(name: str, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> PackedTensor:
    """e4m3 bytes [out, in] with a scale per tensor ([] or [1]), per row ([out, 1]) or per `block`
    ([ceil(out / rows), ceil(in / cols)]), as F8S blocks."""
    out, columns = codes.shape
    if columns % BLOCK:
        raise UnsupportedCheckpointError(f"tensor {name!r}: {columns} input columns, not a multiple of {BLOCK}")
    nb = columns // BLOCK
    scale = scale.float()
    if block is not None:
        rows, cols = block
        expected = (-(-out // rows), -(-columns // cols))
        if tuple(scale.shape) != expected:
            raise UnsupportedCheckpointError(
                f"tensor {name!r}: block scale shape {tuple(scale.shape)}, expected {expected} for blocks {block}")
        per_block = scale.repeat_interleave(rows, 0)[:out].repeat_interleave(cols // BLOCK, 1)[:, :nb]
    elif scale.numel() == 1:
        per_block = scale.reshape(1, 1).expand(out, nb)
    elif tuple(scale.shape) in ((out, 1), (out,)):
        per_block = scale.reshape(out, 1).expand(out, nb)
    else:
        raise UnsupportedCheckpointError(
            f"tensor {name!r}: scale shape {tuple(scale.shape)} is neither per tensor, per row ({out}, 1) nor a "
            f"block scale (set weight_block_size)")
    data = mapped(out, nb * (4 + BLOCK))
    blocks = data.view(out, nb, 4 + BLOCK)
    blocks[..., :4] = _bytes(per_block, out, nb)
    blocks[..., 4:] = codes.contiguous().view(torch.uint8).reshape(out, nb, BLOCK)
    return PackedTensor(data, F8S, (out, columns))
