"""What Qwen2.5-VL and Qwen3-VL share: M-RoPE in the language model (3-D positions for image tokens,
text continuing after the image's largest extent), the towers' 2-D rotary and packed attention, and
the image-model shell (placeholders, the per-request positions hook, checkpoint names).

M-RoPE (transformers' get_rope_index): an image whose merged grid is t x h x w and whose first token
would sit at text position s gets (s + t_i, s + h_i, s + w_i) per token; the text after it continues at
s + max(h, w). Every later position p (prompt or generated) is therefore p + delta, delta the sum over
the images before it of max(h, w) - t * h * w: vLLM's `mrope_position_delta`, and ours per step."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.linear import Linear
from vllmpy.layers.rotary import CosSin, RotaryEmbedding, apply_rotary, rope_parameters
from vllmpy.models.vision_language import VLM_CHECKPOINT_RENAMES, ImageInputs
from vllmpy.multimodal.inputs import ImageFeature
from vllmpy.multimodal.placeholders import PlaceholderLayout
from vllmpy.multimodal.qwen_vl_processor import QwenVLMultiModalProcessor

# transformers 5 writes model.visual / model.language_model; Qwen's hub checkpoints visual / model.
QWEN_VL_RENAMES = VLM_CHECKPOINT_RENAMES[:3] + ((r"^model\.visual\.", "visual."),)
VISION_EPS = 1e-6  # fixed in transformers' vision norms (RMSNorm in Qwen2.5-VL, LayerNorm in Qwen3-VL)
# The largest image's span by default (Qwen2VLImageProcessor's max_pixels / 28^2): the encoder budget's floor.
DEFAULT_MAX_IMAGE_TOKENS = 16384
# The vision-config defaults Qwen2_5_VLVisionConfig and Qwen3VLVisionConfig agree on (each tower adds its own).
VISION_DEFAULTS = {"num_heads": 16, "in_channels": 3, "spatial_merge_size": 2, "temporal_patch_size": 2,
                   "out_hidden_size": 3584}


def text_config(config: dict) -> dict:
    """The LM's config: text_config (transformers 5) or the top level (Qwen's hub configs), with the
    M-RoPE `rope_scaling: {type: mrope}` read as default rope (its sections are read separately)."""
    text = dict(config.get("text_config") or config)
    text["tie_word_embeddings"] = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    params = rope_parameters(text)
    if params.get("rope_type") == "mrope":
        params["rope_type"] = "default"
    text["rope_parameters"] = params
    return text


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary over [3, T] positions (t, h, w): frequency j turns with the axis `axes[j]`. Contiguous
    sections (Qwen2.5-VL: the first mrope_section[0] frequencies by t, then h, then w) or interleaved
    (Qwen3-VL: t, h, w, t, h, w, ... for 3 * mrope_section[1] frequencies, t after). 1-D positions (a
    text-only forward) rotate as plain rope."""

    def __init__(self, rotary_dim: int, params: dict, max_position: int, interleaved_sections: bool) -> None:
        super().__init__(rotary_dim, params, max_position)
        sections = [int(s) for s in params.get("mrope_section") or ()]
        half = rotary_dim // 2
        if len(sections) != 3 or sum(sections) != half:
            raise UnsupportedCheckpointError(f"rope_parameters.mrope_section {sections} must be 3 counts summing "
                                             f"to rotary_dim / 2 = {half}")
        if interleaved_sections:
            j = np.arange(half)
            axes = np.where((j % 3 == 1) & (j < 3 * sections[1]), 1, np.where((j % 3 == 2) & (j < 3 * sections[2]),
                                                                                2, 0))
        else:
            axes = np.repeat([0, 1, 2], sections)
        self.axes = torch.from_numpy(axes.astype(np.int64))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> CosSin:
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        if self.inv_freq.device != positions.device:
            self.inv_freq, self.axes = self.inv_freq.to(positions.device), self.axes.to(positions.device)
        freqs = positions.float()[self.axes].t() * self.inv_freq[None, :]  # [T, half]: axis axes[j] at column j
        emb = torch.cat((freqs, freqs), dim=-1)
        return CosSin((emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype))


def use_mrope(lm: nn.Module, config: dict, interleaved: bool) -> None:
    """Swap the decoder's rotary for M-RoPE (its frequencies are the same; only the positions differ): one
    per layer type (DecoderModel) or the hybrid's one for its attention layers (HybridModel)."""
    def swap(rotary: RotaryEmbedding) -> MRotaryEmbedding:
        return MRotaryEmbedding(rotary.rotary_dim, config["rope_parameters"],
                                config.get("max_position_embeddings", 4096), interleaved)

    if isinstance(lm.model.rotary, RotaryEmbedding):
        lm.model.rotary = swap(lm.model.rotary)
        return
    for kind, rotary in list(lm.model.rotary.items()):
        lm.model.rotary[kind] = swap(rotary)


def mrope_positions(grids: list[tuple[int, int, int, int]], start: int, end: int) -> np.ndarray:
    """[3, end - start] M-RoPE positions of prompt/output positions [start, end); grids: per image in prompt
    order, (offset of its first token, t, h, w) of its merged grid."""
    positions = np.arange(start, end, dtype=np.int64)
    out = np.repeat(positions[None], 3, axis=0)
    shift = 0  # delta of the text before the current image
    for offset, t, h, w in grids:
        length, first = t * h * w, offset + shift
        lo, hi = max(start, offset), min(end, offset + length)
        if lo < hi:
            k = np.arange(lo - offset, hi - offset)
            out[:, lo - start:hi - start] = first + np.stack([k // (h * w), (k // w) % h, k % w])
        shift += max(h, w) - length
        out[:, positions >= offset + length] += max(h, w) - length
    return out


def vision_rotary(rows: int, cols: int, merge: int, head_dim: int, theta: float,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [rows * cols, head_dim] in merge-block patch order (rotate-half layout): the first quarter
    of the frequencies turn with the patch's row, the second with its column (transformers' axial rope)."""
    quarter = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device=device) / quarter))
    r, c = block_positions(rows, cols, merge, device)
    freqs = torch.cat([r[:, None].float() * inv_freq, c[:, None].float() * inv_freq], dim=-1)
    freqs = torch.cat([freqs, freqs], dim=-1)
    return freqs.cos(), freqs.sin()


def block_positions(rows: int, cols: int, merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch in merge-block order: blocks row-major, patches row-major inside a block."""
    index = torch.arange(rows * cols, device=device)
    in_col, in_row = index % merge, (index // merge) % merge
    block = index // (merge * merge)
    return (block // (cols // merge)) * merge + in_row, (block % (cols // merge)) * merge + in_col


def to_block_order(pixel_values: torch.Tensor, merge: int) -> tuple[torch.Tensor, int, int]:
    """[B, t, rows, cols, D] (one grid) -> ([B, t * rows * cols, D] in merge-block order, rows, cols)."""
    batch, t, rows, cols, dim = pixel_values.shape
    blocks = pixel_values.reshape(batch, t, rows // merge, merge, cols // merge, merge, dim)
    return blocks.permute(0, 1, 2, 4, 3, 5, 6).reshape(batch, -1, dim), rows, cols


class PatchEmbed(nn.Module):
    """The Conv3d patch embedding as one matmul: its kernel covers exactly one patch vector."""

    def __init__(self, in_features: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.proj = Linear(in_features, hidden, bias=bias)
        self.proj.weight_loader = _flatten_kernel

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.to(self.proj.weight.dtype))


class VisionTower(nn.Module):
    """What both towers start with: the patch embedding and the 2-D rotary over an image's merge-block
    order; a subclass adds its blocks and mergers."""

    def __init__(self, config: dict, patch_bias: bool) -> None:
        super().__init__()
        hidden, p = config["hidden_size"], config["patch_size"]
        self.merge = config["spatial_merge_size"]
        self.patch_embed = PatchEmbed(config["in_channels"] * config["temporal_patch_size"] * p * p, hidden,
                                      patch_bias)
        self.head_dim = hidden // config["num_heads"]
        self.theta = float((config.get("rope_parameters") or {}).get("rope_theta", 10000.0))

    def embed_patches(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """[B, 1, rows, cols, D] (one grid) -> (patch embeddings in merge-block order, cos, sin, rows, cols)."""
        patches, rows, cols = to_block_order(pixel_values, self.merge)
        x = self.patch_embed(patches)
        cos, sin = vision_rotary(rows, cols, self.merge, self.head_dim, self.theta, x.device)
        return x, cos, sin, rows, cols


def _flatten_kernel(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """A Conv3d kernel [out, C, T, P, P] (or its bias) into the linear's [out, C * T * P * P]."""
    loaded = loaded.reshape(param.shape[0], -1) if param.dim() == 2 else loaded
    if loaded.shape != param.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


@dataclass(frozen=True)
class Windows:
    """An image's patches grouped by attention window: `index` [windows, longest] holds each window's
    patch indices, padded with N (a zero row past the image's N patches); `valid` marks the real ones."""

    index: torch.Tensor
    valid: torch.Tensor


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, windows: Windows,
                       scale: float) -> torch.Tensor:
    """[B, heads, N, D] each -> [B, heads, N, D], every patch attending within its window only: one SDPA
    call over all windows (edge windows padded, their pad keys masked), so the cost is windows x longest^2,
    not N^2."""
    pad = q.new_zeros(q.shape[:2] + (1, q.shape[-1]))
    q, k, v = (torch.cat([t, pad], dim=2)[:, :, windows.index] for t in (q, k, v))  # [B, heads, W, L, D]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=windows.valid[:, None, :], scale=scale)
    result = out.new_empty(out.shape[:2] + (int(windows.valid.sum()), out.shape[-1]))
    result[:, :, windows.index[windows.valid]] = out[:, :, windows.valid]
    return result


class VisionAttention(nn.Module):
    """Bidirectional attention inside each image of a same-grid batch: one SDPA call for the batch (in
    windowed layers, one over all the batch's windows)."""

    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.qkv = Linear(hidden, 3 * hidden, bias=True)
        self.proj = Linear(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                windows: Windows | None = None) -> torch.Tensor:
        batch, length, hidden = x.shape
        qkv = self.qkv(x).reshape(batch * length, 3, self.num_heads, self.head_dim)
        cos, sin = cos.repeat(batch, 1).to(x.dtype), sin.repeat(batch, 1).to(x.dtype)
        q, k = (apply_rotary(qkv[:, i].contiguous(), cos, sin) for i in (0, 1))
        q, k, v = (t.reshape(batch, length, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, qkv[:, 2]))
        scale = self.head_dim ** -0.5
        out = (torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale) if windows is None
               else windowed_attention(q, k, v, windows, scale))
        return self.proj(out.transpose(1, 2).reshape(batch, length, hidden))


class VisionBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then x + mlp(norm2(x)); the family picks the norm and MLP."""

    def __init__(self, config: dict, norm: type[nn.Module], mlp: nn.Module) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.norm1, self.norm2 = norm(hidden, VISION_EPS), norm(hidden, VISION_EPS)
        self.attn = VisionAttention(hidden, config["num_heads"])
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                windows: Windows | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, windows)
        return x + self.mlp(self.norm2(x))


class QwenVLInputs(ImageInputs):
    """The image shell of both families: the LM with M-RoPE, the tower under `visual`, `<|image_pad|>`
    placeholders, one grid per pixel shape, and M-RoPE positions per chunk (the runner asks
    `mrope_positions`, the forward takes them). A family sets the tower class, its config defaults and
    whether its M-RoPE sections interleave."""

    mm_processor_class = QwenVLMultiModalProcessor
    checkpoint_renames = QWEN_VL_RENAMES
    vision_tower: type[nn.Module]
    vision_defaults: dict
    interleaved_mrope: bool

    def __init__(self, config: dict) -> None:
        text = text_config(config)
        super().__init__(text)
        use_mrope(self, text, self.interleaved_mrope)
        self.hidden_size = text["hidden_size"]
        vision = {**self.vision_defaults, **{k: v for k, v in (config.get("vision_config") or {}).items()
                                             if v is not None}}
        self.init_vision_geometry(config, vision)
        self.visual = self.vision_tower(vision)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.visual(pixel_values)

    def init_vision_geometry(self, config: dict, vision: dict) -> None:
        self.patch_size = int(vision.get("patch_size", 14))
        self.spatial_merge_size = int(vision.get("spatial_merge_size", 2))
        self.temporal_patch_size = int(vision.get("temporal_patch_size", 2))
        self.image_token_id = int(config.get("image_token_id", 151655))
        self.vision_tag_ids = (int(config.get("vision_start_token_id", 151652)),
                               int(config.get("vision_end_token_id", 151653)))
        self.tokens_per_image = DEFAULT_MAX_IMAGE_TOKENS

    def placeholder_layout(self, token_to_text) -> PlaceholderLayout:
        image = token_to_text(self.image_token_id)
        start, end = (token_to_text(i) for i in self.vision_tag_ids)
        return PlaceholderLayout(marker=image, expansion=image, image_token_id=self.image_token_id,
                                 tokens_per_image=1, chat_marker=start + image + end)

    def mrope_positions(self, features: list[ImageFeature], start: int, end: int) -> np.ndarray:
        """[3, end - start] for a request's positions [start, end)."""
        m = self.spatial_merge_size
        grids = [(f.offset, f.pixel_values.shape[0], f.pixel_values.shape[1] // m, f.pixel_values.shape[2] // m)
                 for f in features]
        return mrope_positions(grids, start, end)

    def forward(self, input_ids, positions, kv_caches, meta, mm_embeds=None, mrope_positions=None):
        """mrope_positions [3, T] (none in a warm-up or text-only call: plain positions, the same rope)."""
        return super().forward(input_ids, positions if mrope_positions is None else mrope_positions, kv_caches,
                               meta, mm_embeds)
