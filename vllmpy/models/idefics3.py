"""Idefics3 / SmolVLM: a SigLIP tower whose position embeddings are looked up by bucketed patch
coordinates (NaViT-style, so a tile of any size reads the trained grid), a pixel-shuffle connector
(each scale x scale block of patch states folded into one token, then one matmul into the LM's width)
and a Llama LM. An image is its tiles plus the global image; each tile is one run of image tokens."""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.linear import Linear
from vllmpy.models.llama import LlamaForCausalLM
from vllmpy.models.siglip import SiglipVisionEmbeddings, SiglipVisionTransformer, vision_config
from vllmpy.models.vision_language import ImageInputs
from vllmpy.multimodal.idefics3_processor import Idefics3MultiModalProcessor
from vllmpy.multimodal.placeholders import PlaceholderLayout

# Idefics3VisionConfig's defaults (hub configs list only what differs).
IDEFICS3_VISION_DEFAULTS = {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12,
                            "num_attention_heads": 16, "num_channels": 3, "image_size": 224, "patch_size": 32,
                            "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}
IDEFICS3_RENAMES = ((r"^model\.vision_model\.", "vision_model."), (r"^model\.connector\.", "connector."),
                    (r"^model\.text_model\.", "model."))


class Idefics3VisionEmbeddings(SiglipVisionEmbeddings):
    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.patch_size = config["patch_size"]
        self.per_side = config["image_size"] // config["patch_size"]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))  # [B, D, h, w]
        ids = self._position_ids(patches.shape[2], patches.shape[3], patches.device)
        return patches.flatten(2).transpose(1, 2) + self.position_embedding(ids)

    def _position_ids(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """Each patch's fractional coordinate bucketed onto the trained per_side grid, computed in the same
        float32 steps as transformers so a boundary falls the same way."""
        n = self.per_side
        boundaries = torch.arange(1 / n, 1.0, 1 / n, device=device)

        def buckets(count: int) -> torch.Tensor:
            step = 1.0 / torch.tensor([count], device=device)
            coords = torch.arange(count, device=device, dtype=torch.float32)[None, :] * step[:, None]
            return torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)[0]

        return (buckets(rows)[:, None] * n + buckets(cols)[None, :]).reshape(-1)


class Idefics3VisionTransformer(SiglipVisionTransformer):
    """The checkpoint's `model.vision_model`: SigLIP's layers with bucketed position embeddings."""

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.embeddings = Idefics3VisionEmbeddings(config)


class Idefics3Connector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, scale: int) -> None:
        super().__init__()
        self.scale = scale
        self.modality_projection = nn.Module()
        self.modality_projection.proj = Linear(vision_hidden * scale * scale, text_hidden, bias=False)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """[B, side*side, D] -> [B, (side/scale)^2, text_hidden]: transformers' pixel_shuffle order (a
        scale x scale block's states concatenated row-major)."""
        batch, seq, dim = states.shape
        side, s = int(seq ** 0.5), self.scale
        x = states.reshape(batch, side, side // s, dim * s).permute(0, 2, 1, 3)
        x = x.reshape(batch, side // s, side // s, dim * s * s).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(batch, seq // (s * s), dim * s * s))


class Idefics3ForConditionalGeneration(ImageInputs, LlamaForCausalLM):
    """Parameters: the LM under `model.` / `lm_head.`, `vision_model.`, `connector.`. pixel_values per
    image: [tiles, 3, tile, tile]; encode_images returns its tiles' rows in prompt order."""

    mm_processor_class = Idefics3MultiModalProcessor

    def __init__(self, config: dict) -> None:
        text = {"rms_norm_eps": 1e-5, **(config.get("text_config") or {}),
                "tie_word_embeddings": config.get("tie_word_embeddings", False)}
        if text.get("model_type", "llama") != "llama":
            raise UnsupportedCheckpointError(f"Idefics3 text_config.model_type {text['model_type']!r} is not "
                                             f"supported; supported: llama")
        super().__init__(text)
        self.checkpoint_renames = IDEFICS3_RENAMES + tuple(LlamaForCausalLM.checkpoint_renames)
        vision = vision_config(config.get("vision_config") or {}, IDEFICS3_VISION_DEFAULTS)
        self.vision_model = Idefics3VisionTransformer(vision)
        scale = int(config.get("scale_factor", 2))
        per_side = vision["image_size"] // vision["patch_size"]
        if per_side % scale:
            raise UnsupportedCheckpointError(f"scale_factor {scale} must divide the {per_side}x{per_side} patch grid")
        self.connector = Idefics3Connector(vision["hidden_size"], text["hidden_size"], scale)
        self.tokens_per_image = (per_side // scale) ** 2  # per tile
        self.image_token_id = int(config.get("image_token_id", 128257))

    def placeholder_layout(self, token_to_text) -> PlaceholderLayout:
        """The marker is the image token; a one-tile image's run stands as the fixed expansion."""
        image = token_to_text(self.image_token_id)
        return PlaceholderLayout(marker=image, expansion=image * self.tokens_per_image,
                                 image_token_id=self.image_token_id, tokens_per_image=self.tokens_per_image)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, tiles, 3, S, S] -> [B, tiles * tokens_per_image, hidden]."""
        batch, tiles = pixel_values.shape[:2]
        rows = self.connector(self.vision_model(pixel_values.flatten(0, 1)))
        return rows.reshape(batch, tiles * rows.shape[1], rows.shape[2])
