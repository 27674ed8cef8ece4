"""CLIP vision tower (LLaVA): a class token before the patches, learned positions, a LayerNorm before
the encoder (`pre_layrnorm`, as the checkpoints spell it); the encoder layers are SigLIP's."""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.layers.norm import LayerNorm
from vllmpy.models.siglip import VisionEncoder

# CLIPVisionConfig's defaults, for checkpoints whose vision_config leaves them out.
CLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                 "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu",
                 "layer_norm_eps": 1e-5}


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        patch, hidden = config["patch_size"], config["hidden_size"]
        self.class_embedding = nn.Parameter(torch.empty(hidden), requires_grad=False)
        self.patch_embedding = nn.Conv2d(config["num_channels"], hidden, kernel_size=patch, stride=patch, bias=False)
        self.position_embedding = nn.Embedding((config["image_size"] // patch) ** 2 + 1, hidden)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPVisionTransformer(nn.Module):
    """Built up to `num_layers` encoder layers: LLaVA reads an earlier layer's states, so the rest (and the
    post-norm, which only the pooled output reads) are never built."""

    def __init__(self, config: dict, num_layers: int) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = LayerNorm(config["hidden_size"], config["layer_norm_eps"])
        self.encoder = VisionEncoder(config, num_layers)

    def hidden_states(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        return self.encoder.hidden_states(self.pre_layrnorm(self.embeddings(pixel_values)))


class CLIPVisionModel(nn.Module):
    def __init__(self, config: dict, num_layers: int) -> None:
        super().__init__()
        self.vision_model = CLIPVisionTransformer(config, num_layers)

    def hidden_states(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        return self.vision_model.hidden_states(pixel_values)
