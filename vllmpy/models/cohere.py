"""Command-R (Cohere) and Command-R7B / Command-A (Cohere 2).

Cohere: one LayerNorm (no bias) feeding attention and MLP in parallel; interleaved (GPT-J) rotary;
optional per-head q/k LayerNorm with a weight per head (`use_qk_norm`); tied head whose logits are
multiplied by logit_scale.
Cohere 2: the same block with sliding-window layers (three of every four); the global layers use no
rotary at all.
"""
from __future__ import annotations

import functools

import torch

from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import LayerNorm
from vllmpy.models.base import CausalLM
from vllmpy.models.llama import Attention, DecoderLayer, DecoderModel, norm_eps

CohereLayerNorm = functools.partial(LayerNorm, bias=False)


class CohereForCausalLM(CausalLM):
    global_rope = True  # Cohere 2: rotary on sliding layers only

    def __init__(self, config: dict) -> None:
        config = {"tie_word_embeddings": True, "layer_norm_eps": 1e-5, **config}
        super().__init__(config)
        bias = bool(config.get("attention_bias", False))
        qk_norm = CohereLayerNorm if config.get("use_qk_norm") else None
        layers = [DecoderLayer(config, Attention(config, kind, qkv_bias=bias, o_bias=bias, qk_norm=qk_norm,
                                                 qk_norm_layout="per_head",
                                                 rope=self.global_rope or kind == "sliding_attention"),
                               norm=CohereLayerNorm, parallel=True)
                  for kind in self.layer_types(config)]
        self.model = DecoderModel(config, layers, CohereLayerNorm(config["hidden_size"], norm_eps(config)),
                                  rope_interleaved=True)
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"])
        self.logit_scale = config.get("logit_scale", 0.0625)
        self.tie_weights()

    def layer_types(self, config: dict) -> list[str]:
        return ["full_attention"] * config["num_hidden_layers"]

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.logit_scale


class Cohere2ForCausalLM(CohereForCausalLM):
    global_rope = False

    def __init__(self, config: dict) -> None:
        # head_dim is always hidden / heads (transformers overrides a stated one)
        super().__init__({**config, "head_dim": config["hidden_size"] // config["num_attention_heads"]})

    def layer_types(self, config: dict) -> list[str]:
        if config.get("layer_types"):
            return list(config["layer_types"])
        pattern = config.get("sliding_window_pattern", 4)
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(config["num_hidden_layers"])]
