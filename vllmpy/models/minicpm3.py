"""MiniCPM3: dense MLA (attention/mla.py, rotate-half rope, usually LongRoPE) with MiniCPM's muP scalars:
embeddings times scale_emb, each residual branch times scale_depth / sqrt(num_hidden_layers), and the
final hidden state divided by hidden_size / dim_model_base before the (tied) head."""
from __future__ import annotations

import math

import torch

from vllmpy.attention.mla import MultiHeadLatentAttention
from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import RMSNorm
from vllmpy.models.base import CausalLM
from vllmpy.models.granite import GraniteModel
from vllmpy.models.llama import DecoderLayer, norm_eps


class MiniCPM3ForCausalLM(CausalLM):
    # The attention projections keep their checkpoint names (no q_proj -> qkv_proj).
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: dict) -> None:
        config = {"tie_word_embeddings": True, **config}  # MiniCPM3's default
        super().__init__(config)
        n, hidden = config["num_hidden_layers"], config["hidden_size"]
        depth = config.get("scale_depth")
        residual = (math.sqrt(n) if depth is None else depth) / math.sqrt(n)
        layers = [DecoderLayer(config, MultiHeadLatentAttention(config), residual_multiplier=residual)
                  for _ in range(n)]
        self.model = GraniteModel(config, layers, RMSNorm(hidden, norm_eps(config)))
        self.model.embedding_multiplier = config.get("scale_emb", 1.0)
        self.lm_head = Linear(hidden, config["vocab_size"])
        self.hidden_scale = hidden / (config.get("dim_model_base") or hidden)
        self.tie_weights()

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden / self.hidden_scale)
