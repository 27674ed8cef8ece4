"""Qwen2.5-VL: a ViT on each image at its own resolution (patch embedding as one matmul, 2-D rotary,
RMSNorm + SwiGLU blocks, windowed attention except in `fullatt_block_indexes`), a patch merger folding
each merge x merge block into one LM token, and the Qwen2 LM with M-RoPE.

Windows: transformers reorders the patches so each window is contiguous and attends window by window;
here the patches keep the merge-block order and windowed layers gather each window's patches (padded
to the longest window) for one SDPA call over all windows, then scatter back: the same attention, since
rotary carries the positions and every other op is per token."""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import RMSNorm
from vllmpy.models.llama import GatedMLP
from vllmpy.models.qwen2 import Qwen2ForCausalLM
from vllmpy.models.qwen_vl import VISION_EPS, QwenVLInputs, VisionBlock, VisionTower, Windows, block_positions
from vllmpy.models.qwen_vl import VISION_DEFAULTS as QWEN_VL_VISION_DEFAULTS

# Qwen2_5_VLVisionConfig's defaults (hub configs list only what differs).
VISION_DEFAULTS = {**QWEN_VL_VISION_DEFAULTS, "depth": 32, "hidden_size": 1280, "hidden_act": "silu",
                   "intermediate_size": 3420, "patch_size": 14, "window_size": 112,
                   "fullatt_block_indexes": [7, 15, 23, 31]}


class PatchMerger(nn.Module):
    """RMSNorm per patch, then each merge-block's patches concatenated through a 2-layer GELU MLP."""

    def __init__(self, context: int, out: int, merge: int) -> None:
        super().__init__()
        self.width = context * merge * merge
        self.ln_q = RMSNorm(context, VISION_EPS)
        self.mlp = nn.Sequential(Linear(self.width, self.width, bias=True), nn.GELU(),
                                 Linear(self.width, out, bias=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(x.shape[0], -1, self.width))


class Qwen2_5_VisionTransformer(VisionTower):
    """The checkpoint's `visual`: patch_embed, blocks, merger."""

    def __init__(self, config: dict) -> None:
        super().__init__(config, patch_bias=False)
        hidden, p = config["hidden_size"], config["patch_size"]
        self.blocks = nn.ModuleList(
            VisionBlock(config, RMSNorm, GatedMLP(hidden, config["intermediate_size"], config["hidden_act"], bias=True))
            for _ in range(config["depth"]))
        self.merger = PatchMerger(hidden, config["out_hidden_size"], self.merge)
        self.full_attention = set(config["fullatt_block_indexes"])
        self.window = config["window_size"] // self.merge // p  # merged patches per window side

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 1, rows, cols, D] (one grid) -> [B, rows * cols / merge^2, out_hidden_size]."""
        x, cos, sin, rows, cols = self.embed_patches(pixel_values)
        windows = self.windows(rows, cols, x.device)
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if index in self.full_attention else windows)
        return self.merger(x)

    def windows(self, rows: int, cols: int, device: torch.device) -> Windows:
        """Windows of `window` x `window` merged patches, row-major from the top left (edge ones smaller)."""
        side = self.merge * self.window  # patches per window side
        r, c = block_positions(rows, cols, self.merge, device)
        window = (r // side) * -(-cols // side) + c // side
        order = torch.argsort(window, stable=True)
        counts = torch.bincount(window)
        first = torch.cumsum(counts, 0) - counts
        slot = torch.arange(len(order), device=device) - first[window[order]]
        index = torch.full((len(counts), int(counts.max())), len(order), dtype=torch.long, device=device)
        index[window[order], slot] = order
        return Windows(index, index < len(order))


class Qwen2_5_VLForConditionalGeneration(QwenVLInputs, Qwen2ForCausalLM):
    """Parameters: the LM under `model.` / `lm_head.`, the tower under `visual.`."""

    vision_tower = Qwen2_5_VisionTransformer
    vision_defaults = VISION_DEFAULTS
    interleaved_mrope = False
