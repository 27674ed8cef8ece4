"""Qwen3-VL: a ViT on each image at its own resolution (patch embedding as one matmul plus a learned
square position table bilinearly resized to the image's grid, 2-D rotary, LayerNorm + GELU blocks, full
attention per image), a patch merger, and DeepStack: the states after `deepstack_visual_indexes` blocks,
each through its own merger, are added to the image tokens' hidden states after the LM's first layers.
The LM is Qwen3 with interleaved M-RoPE.

The encoder output per image is [tokens, hidden * (1 + deepstack levels)] (vLLM's layout): the first
`hidden` columns replace the placeholder embeddings, the rest are added level by level, so the runner's
encoder cache and chunked prefill handle every level alike."""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import LayerNorm
from vllmpy.models.llama import MLP
from vllmpy.models.qwen3 import Qwen3ForCausalLM
from vllmpy.models.qwen_vl import QWEN_VL_RENAMES, VISION_EPS, QwenVLInputs, VisionBlock, VisionTower, block_positions
from vllmpy.models.qwen_vl import VISION_DEFAULTS as QWEN_VL_VISION_DEFAULTS

# Qwen3VLVisionConfig's defaults (hub configs list only what differs).
VISION_DEFAULTS = {**QWEN_VL_VISION_DEFAULTS, "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh",
                   "intermediate_size": 4304, "patch_size": 16, "num_position_embeddings": 2304,
                   "deepstack_visual_indexes": [8, 16, 24]}
QWEN3_VL_RENAMES = QWEN_VL_RENAMES + ((r"^(visual\.blocks\.\d+\.mlp\.)linear_fc", r"\1fc"),)


class PatchMerger(nn.Module):
    """LayerNorm per patch (or, post-shuffle, over the concatenated block), then a 2-layer GELU MLP."""

    def __init__(self, context: int, out: int, merge: int, post_shuffle: bool) -> None:
        super().__init__()
        self.width, self.post_shuffle = context * merge * merge, post_shuffle
        self.norm = LayerNorm(self.width if post_shuffle else context, VISION_EPS)
        self.linear_fc1 = Linear(self.width, self.width, bias=True)
        self.linear_fc2 = Linear(self.width, out, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = x.reshape(x.shape[0], -1, self.width)
        x = self.norm(blocks) if self.post_shuffle else self.norm(x).reshape(blocks.shape)
        return self.linear_fc2(torch.nn.functional.gelu(self.linear_fc1(x)))


class Qwen3VLVisionModel(VisionTower):
    """The checkpoint's `visual`: patch_embed, pos_embed, blocks, merger, deepstack_merger_list."""

    def __init__(self, config: dict) -> None:
        super().__init__(config, patch_bias=True)
        hidden, out = config["hidden_size"], config["out_hidden_size"]
        self.pos_embed = nn.Embedding(config["num_position_embeddings"], hidden)
        self.pos_embed.weight.requires_grad_(False)
        self.side = int(config["num_position_embeddings"] ** 0.5)
        self.blocks = nn.ModuleList(
            VisionBlock(config, LayerNorm, MLP(hidden, config["intermediate_size"], config["hidden_act"]))
            for _ in range(config["depth"]))
        self.merger = PatchMerger(hidden, out, self.merge, post_shuffle=False)
        self.deepstack_indexes = list(config["deepstack_visual_indexes"])
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(hidden, out, self.merge, post_shuffle=True)
                                                   for _ in self.deepstack_indexes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 1, rows, cols, D] (one grid) -> [B, rows * cols / merge^2, out * (1 + deepstack levels)]."""
        x, cos, sin, rows, cols = self.embed_patches(pixel_values)
        x = x + self.position_table(rows, cols).to(pixel_values.dtype)
        levels = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin)
            if index in self.deepstack_indexes:
                levels.append(self.deepstack_merger_list[self.deepstack_indexes.index(index)](x))
        return torch.cat([self.merger(x), *levels], dim=-1)

    def position_table(self, rows: int, cols: int) -> torch.Tensor:
        """[rows * cols, hidden] in merge-block order: the square table resized to rows x cols (bilinear,
        corners aligned, as transformers resamples it)."""
        r, c = block_positions(rows, cols, self.merge, self.pos_embed.weight.device)
        (r0, r1), wr = _taps(r, rows, self.side)
        (c0, c1), wc = _taps(c, cols, self.side)
        table = self.pos_embed.weight
        return ((table[r0 * self.side + c0] * ((1 - wr) * (1 - wc))[:, None])
                + (table[r0 * self.side + c1] * ((1 - wr) * wc)[:, None])
                + (table[r1 * self.side + c0] * (wr * (1 - wc))[:, None])
                + (table[r1 * self.side + c1] * (wr * wc)[:, None]))


def _taps(index: torch.Tensor, size: int, side: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The two table rows an index of an axis of `size` reads, and the second one's weight."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    low = src.floor()
    return (low.long().clamp(0, side - 1), (low.long() + 1).clamp(0, side - 1)), src - low


class Qwen3VLForConditionalGeneration(QwenVLInputs, Qwen3ForCausalLM):
    """Parameters: the LM under `model.` / `lm_head.`, the tower under `visual.`."""

    checkpoint_renames = QWEN3_VL_RENAMES
    vision_tower = Qwen3VLVisionModel
    vision_defaults = VISION_DEFAULTS
    interleaved_mrope = True

    def forward(self, input_ids, positions, kv_caches, meta, mm_embeds=None, mrope_positions=None):
        """The decoder loop with DeepStack: level i's rows are added after layer i."""
        lm = self.model
        x = lm.embed(input_ids)
        levels: list[torch.Tensor] = []
        if mm_embeds is not None:
            rows, embeds = mm_embeds
            embeds = embeds.to(x.dtype)
            x = x.index_copy(0, rows, embeds[:, :self.hidden_size])
            levels = list(embeds[:, self.hidden_size:].split(self.hidden_size, dim=-1))
        cos_sin = lm.position_inputs(positions if mrope_positions is None else mrope_positions, x.dtype)
        for index, (layer, kv_cache, layer_meta) in enumerate(zip(lm.layers, kv_caches, meta)):
            x = layer(x, cos_sin.get(layer.self_attn.layer_type), kv_cache, layer_meta)
            if index < len(levels):
                x = x.index_add(0, rows, levels[index])
        return lm.norm(x)
