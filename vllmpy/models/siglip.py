"""SigLIP vision tower (Gemma 3, some LLaVA checkpoints): patch embedding + learned positions, pre-norm
bidirectional encoder layers, a final LayerNorm. The attention-pooling head is not built (Gemma 3 and
LLaVA read the patch states)."""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.layers.activation import get_activation
from vllmpy.layers.linear import Linear, MergedLinear
from vllmpy.layers.norm import LayerNorm
from vllmpy.models.llama import MLP

# SiglipVisionConfig's defaults, for checkpoints whose vision_config leaves them out.
SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                   "layer_norm_eps": 1e-6}


class VisionAttention(nn.Module):
    """Every patch sees every patch of its image: one SDPA call over the whole batch of images."""

    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.qkv_proj = MergedLinear(hidden, {"q": hidden, "k": hidden, "v": hidden}, bias=True)
        self.out_proj = Linear(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = (t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv_proj.split(self.qkv_proj(x)))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, hidden))


class VisionEncoderLayer(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config["layer_norm_eps"]
        self.layer_norm1 = LayerNorm(hidden, eps)
        self.self_attn = VisionAttention(hidden, config["num_attention_heads"])
        self.layer_norm2 = LayerNorm(hidden, eps)
        self.mlp = MLP(hidden, config["intermediate_size"], config["hidden_act"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config: dict, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def hidden_states(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The input, then every layer's output (transformers' hidden_states)."""
        states = [x]
        for layer in self.layers:
            states.append(layer(states[-1]))
        return states


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        patch, hidden = config["patch_size"], config["hidden_size"]
        self.patch_embedding = nn.Conv2d(config["num_channels"], hidden, kernel_size=patch, stride=patch)
        self.num_patches = (config["image_size"] // patch) ** 2
        self.position_embedding = nn.Embedding(self.num_patches, hidden)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))  # [B, D, h, w]
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipVisionTransformer(nn.Module):
    def __init__(self, config: dict, num_layers: int | None = None, post_layernorm: bool = True) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = VisionEncoder(config, config["num_hidden_layers"] if num_layers is None else num_layers)
        self.post_layernorm = LayerNorm(config["hidden_size"], config["layer_norm_eps"]) if post_layernorm else None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> the last layer's patch states [B, patches, hidden] (post-norm applied if built)."""
        x = self.encoder(self.embeddings(pixel_values))
        return x if self.post_layernorm is None else self.post_layernorm(x)

    def hidden_states(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        return self.encoder.hidden_states(self.embeddings(pixel_values))


class SiglipVisionModel(nn.Module):
    """The checkpoint's `vision_tower`: its tensors live under `vision_tower.vision_model.`."""

    def __init__(self, config: dict, num_layers: int | None = None, post_layernorm: bool = True) -> None:
        super().__init__()
        self.vision_model = SiglipVisionTransformer(config, num_layers, post_layernorm)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.vision_model(pixel_values)

    def hidden_states(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        return self.vision_model.hidden_states(pixel_values)


def vision_config(config: dict, defaults: dict = SIGLIP_DEFAULTS) -> dict:
    """A tower's vision_config with its transformers config class's defaults filled in."""
    config = {**defaults, **{k: v for k, v in config.items() if v is not None}}
    get_activation(config["hidden_act"])  # refuse an unknown activation at construction
    return config
