"""The decoder every hybrid family shares: layers whose mixer is attention or a recurrent layer (one that
declares `recurrent_state_spec`: Mamba2, Gated DeltaNet, short conv), chosen per layer, each holding its
caches in forward order; optional rotary (NoPE families have none) and Granite-style muP multipliers on
the embeddings and the residual branches."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vllmpy.attention.base import AttentionMetadata
from vllmpy.layers.embedding import VocabEmbedding
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.recurrent_state import RecurrentMetadata, RecurrentState
from vllmpy.layers.rotary import CosSin, RotaryEmbedding, rope_parameters, rotary_dim
from vllmpy.models.base import CausalLM
from vllmpy.models.llama import norm_eps

Norm = Callable[..., nn.Module]  # norm(dim, eps)
Cache = torch.Tensor | RecurrentState
Meta = AttentionMetadata | RecurrentMetadata


class HybridDecoderLayer(nn.Module):
    """x + m * mixer(norm(x)), then x + m * mlp(norm(x)); m is Granite's residual_multiplier (else 1). A
    recurrent mixer is `linear_attn`, attention `self_attn` (Qwen3.5's checkpoint names; other families
    rename theirs onto these)."""

    def __init__(self, config: dict, mixer: nn.Module, mlp: nn.Module, norm: Norm = RMSNorm,
                 residual_multiplier: float = 1.0) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], norm_eps(config)
        self.recurrent = hasattr(mixer, "recurrent_state_spec")
        self.input_layernorm = norm(hidden, eps)
        if self.recurrent:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.post_attention_layernorm = norm(hidden, eps)
        self.mlp = mlp
        self.residual_multiplier = residual_multiplier

    def forward(self, x: torch.Tensor, cos_sin: CosSin | None, caches: list[Cache], metas: list[Meta]) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.recurrent:
            h = self.linear_attn(h, caches[0], metas[0])
        else:
            h = self.self_attn(h, cos_sin, caches[0], metas[0])
        x = x + h * self.residual_multiplier
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier


class HybridModel(nn.Module):
    """Embedding (times embedding_multiplier), layers, final norm; one rotary for the attention layers
    unless `rope` is off. Each layer takes `forward(x, cos_sin, caches, metas)` with the caches of its own
    attention / recurrent modules (none for an MLP-only block, two for Falcon-H1's parallel mixers)."""

    def __init__(self, config: dict, layers: list[nn.Module], norm: Norm = RMSNorm, rope: bool = True,
                 embedding_multiplier: float = 1.0, eps: float | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(layers)
        self.norm = norm(config["hidden_size"], norm_eps(config) if eps is None else eps)
        self.embedding_multiplier = embedding_multiplier
        # caches are handed out in module order, the order the runner allocates them in
        counts = [len(CausalLM.stateful_layers(layer)) for layer in layers]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        self.cache_slices = [slice(start, start + count) for start, count in zip(starts, counts)]
        self.rotary = None
        if rope:
            head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
            self.rotary = RotaryEmbedding(rotary_dim(config, head_dim), rope_parameters(config),
                                          config.get("max_position_embeddings", 4096))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings (times embedding_multiplier): what an image model splices its rows into."""
        x = self.embed_tokens(input_ids)
        return x * self.embedding_multiplier if self.embedding_multiplier != 1.0 else x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: list, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """inputs_embeds: the embedded tokens when the caller built them (image rows spliced in)."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        cos_sin = None if self.rotary is None else self.rotary.cos_sin(positions, x.dtype)
        for layer, caches in zip(self.layers, self.cache_slices):
            x = layer(x, cos_sin, kv_caches[caches], meta[caches])
        return self.norm(x)
