"""The Pixtral vision tower (Mistral 3's): an image at its own resolution, cut into patches, RMS-normed,
then transformer layers whose attention rotates queries and keys by the patch's row and column (axial
2-D rotary: half the frequencies turn with the row, half with the column). Images of one size are one
batch, so each image attends only to itself in one SDPA call."""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.layers.linear import Linear, MergedLinear
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import apply_rotary
from vllmpy.models.llama import GatedMLP

# PixtralVisionConfig's defaults (hub configs list only what differs).
PIXTRAL_DEFAULTS = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                    "num_attention_heads": 16, "num_channels": 3, "image_size": 1024, "patch_size": 16,
                    "hidden_act": "gelu", "rope_theta": 10000.0}
_NORM_EPS = 1e-5  # fixed in transformers' Pixtral layers


def pixtral_config(config: dict) -> dict:
    config = {**PIXTRAL_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    return {**config, "rope_theta": float(theta if theta is not None else config["rope_theta"])}


class AxialRotary:
    """Not a module: nothing to load, and computed per call so meta-device construction cannot touch it."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim, self.theta = head_dim, theta

    def __call__(self, rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [rows * cols, head_dim] for the row-major patch grid (rotate-half layout): the even
        frequencies turn with the row, the odd ones with the column."""
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float, device=device)
                                         / self.head_dim))
        r = torch.arange(rows, device=device).repeat_interleave(cols).float()
        c = torch.arange(cols, device=device).repeat(rows).float()
        freqs = torch.cat([r[:, None] * inv_freq[0::2], c[:, None] * inv_freq[1::2]], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()


class PixtralAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.qkv_proj = MergedLinear(hidden, {"q": hidden, "k": hidden, "v": hidden})
        self.o_proj = Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = (t.reshape(batch * length, self.num_heads, self.head_dim)
                   for t in self.qkv_proj.split(self.qkv_proj(x)))
        cos, sin = cos.repeat(batch, 1).to(x.dtype), sin.repeat(batch, 1).to(x.dtype)
        q, k, v = (t.reshape(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, hidden))


class PixtralLayer(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.attention_norm = RMSNorm(hidden, _NORM_EPS)
        self.attention = PixtralAttention(hidden, config["num_attention_heads"])
        self.ffn_norm = RMSNorm(hidden, _NORM_EPS)
        self.feed_forward = GatedMLP(hidden, config["intermediate_size"], config["hidden_act"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralVisionModel(nn.Module):
    """The checkpoint's `vision_tower`: patch_conv, ln_pre, transformer.layers."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, self.patch_size = config["hidden_size"], config["patch_size"]
        self.patch_conv = nn.Conv2d(config["num_channels"], hidden, kernel_size=self.patch_size,
                                    stride=self.patch_size, bias=False)
        self.patch_conv.weight.requires_grad_(False)
        self.ln_pre = RMSNorm(hidden, _NORM_EPS)
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(PixtralLayer(config) for _ in range(config["num_hidden_layers"]))
        self.rotary = AxialRotary(hidden // config["num_attention_heads"], config["rope_theta"])

    def hidden_states(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """[B, 3, H, W] (H, W whole patches) -> [the normed patch embeddings, then each layer's output],
        each [B, rows * cols, hidden] row-major (transformers' hidden_states indexing)."""
        patches = self.patch_conv(pixel_values.to(self.patch_conv.weight.dtype))
        rows, cols = patches.shape[2:]
        cos, sin = self.rotary(rows, cols, patches.device)
        states = [self.ln_pre(patches.flatten(2).transpose(1, 2))]
        for layer in self.transformer.layers:
            states.append(layer(states[-1], cos, sin))
        return states
