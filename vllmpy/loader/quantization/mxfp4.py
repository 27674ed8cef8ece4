"""MXFP4 expert stacks as openai/gpt-oss checkpoints store them, repacked exactly into GGML MXFP4 blocks.

On disk (transformers' Mxfp4GptOssExperts layout), per MoE layer `<experts>`:
- `<experts>.gate_up_proj_blocks` uint8 [E, 2I, H / 32, 16] and `.gate_up_proj_scales` uint8 [E, 2I, H / 32];
- `<experts>.down_proj_blocks` uint8 [E, H, I / 32, 16] and `.down_proj_scales` uint8 [E, H, I / 32].
Each row is an output feature; a block is 32 of its input columns: byte j holds e2m1 codes of values 2j (low
nibble) and 2j + 1 (high), value = e2m1(code) * 2^(scale - 127) (OCP MX; e2m1 0, .5, 1, 1.5, 2, 3, 4, 6 and
their negatives). gate_up's rows alternate gate and up (gpt-oss's `gate_up[..., ::2]`, `[..., 1::2]`).

A GGML MXFP4 block (type 39) is the scale byte, then 16 bytes holding values j (low nibble) and j + 16 (high),
value = 2 e2m1(code) * 2^(scale - 128): the same numbers, so the repack only moves nibbles, and the blocks stay
packed per expert (the experts' per-expert HF names, gate and up as two parts of the fused projection).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.quantized import PackedTensor

MXFP4 = 39  # GGML's type id
BLOCK, BLOCK_BYTES = 32, 16  # values and code bytes per block
PROJECTIONS = ("gate_up_proj", "down_proj")
COMPONENTS = tuple(f"{proj}_{part}" for proj in PROJECTIONS for part in ("blocks", "scales"))

Getter = Callable[[str], torch.Tensor]


def to_ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [..., nb, 16] codes (values 2j, 2j + 1 in byte j) and [..., nb] scales -> [..., nb * 17]
    GGML MXFP4 blocks (the scale byte, then values j, j + 16 in byte j)."""
    values = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2)  # [..., nb, 32] in column order
    codes = values[..., :BLOCK // 2] | (values[..., BLOCK // 2:] << 4)
    return torch.cat([scales.unsqueeze(-1), codes], dim=-1).flatten(-2)


def _checked(module: str, proj: str, get: Getter) -> tuple[torch.Tensor, torch.Tensor]:
    """The projection's blocks and scales, refused by name unless they have the layout above."""
    blocks, scales = get(f"{module}.{proj}_blocks"), get(f"{module}.{proj}_scales")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise UnsupportedCheckpointError(
            f"tensors {module}.{proj}_blocks / _scales have dtypes {blocks.dtype} / {scales.dtype}; MXFP4 needs uint8")
    if blocks.dim() != 4 or blocks.shape[-1] != BLOCK_BYTES or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise UnsupportedCheckpointError(
            f"tensor {module}.{proj}_blocks has shape {tuple(blocks.shape)} with scales {tuple(scales.shape)}; "
            f"MXFP4 expert stacks are [experts, out, in / {BLOCK}, {BLOCK_BYTES}] with scales "
            f"[experts, out, in / {BLOCK}]")
    return blocks, scales


def read_experts(module: str, get: Getter) -> list[tuple[str, PackedTensor]]:
    """An MoE layer's MXFP4 expert stacks as packed per-expert weights under HF per-expert names
    (`<module>.3.gate_proj.weight`, `.up_proj`, `.down_proj`)."""
    out = []
    for proj in PROJECTIONS:
        blocks, scales = _checked(module, proj, get)
        experts, rows, nb, _ = blocks.shape
        if proj == "gate_up_proj" and rows % 2:
            raise UnsupportedCheckpointError(f"tensor {module}.gate_up_proj_blocks has an odd row count {rows}")
        for e in range(experts):  # one expert at a time: the repack's temporaries stay a fraction of the stack
            packed = to_ggml_blocks(blocks[e], scales[e])
            if proj == "down_proj":
                parts = {"down_proj": packed}
            else:
                parts = {"gate_proj": packed[0::2].contiguous(), "up_proj": packed[1::2].contiguous()}
            out.extend((f"{module}.{e}.{name}.weight", PackedTensor(data, MXFP4, (data.shape[0], nb * BLOCK)))
                       for name, data in parts.items())
    return out
