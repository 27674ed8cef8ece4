"""Granite (3.x dense): the Llama block with four scalars from muP training: embeddings times
embedding_multiplier, attention scores times attention_multiplier (instead of 1/sqrt(head_dim)),
each residual branch times residual_multiplier, logits divided by logits_scaling."""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import RMSNorm
from vllmpy.models.base import CausalLM
from vllmpy.models.llama import Attention, DecoderLayer, DecoderModel, norm_eps


class GraniteModel(DecoderModel):
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(CausalLM):
    def __init__(self, config: dict) -> None:
        super().__init__(config)
        bias = bool(config.get("attention_bias", False))
        layers = [DecoderLayer(config, Attention(config, "full_attention", qkv_bias=bias, o_bias=bias,
                                                 scale=config.get("attention_multiplier", 1.0)),
                               self.make_mlp(config), residual_multiplier=config.get("residual_multiplier", 1.0))
                  for _ in range(config["num_hidden_layers"])]
        self.model = GraniteModel(config, layers, RMSNorm(config["hidden_size"], norm_eps(config)))
        self.model.embedding_multiplier = config.get("embedding_multiplier", 1.0)
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"])
        self.logits_scaling = config.get("logits_scaling", 1.0)
        self.tie_weights()

    def make_mlp(self, config: dict) -> nn.Module | None:
        """None: the dense gated MLP (Granite-MoE returns its sparse block)."""
        return None

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling
