"""Gemma 3 (text): interleaved sliding-window and global layers, each with its own rope base;
Gemma RMSNorm (1 + w) around both attention and MLP; embeddings scaled by sqrt(hidden);
q/k norm; attention scale from query_pre_attn_scalar; optional logit soft-capping."""
from __future__ import annotations

import torch

from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import GemmaRMSNorm
from vllmpy.models.base import CausalLM
from vllmpy.models.llama import Attention, DecoderModel, GatedMLP, SandwichDecoderLayer


def gemma3_layer_types(config: dict, default_pattern: int = 6) -> list[str]:
    if config.get("layer_types"):
        return list(config["layer_types"])
    pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or default_pattern
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(config["num_hidden_layers"])]


class Gemma3DecoderLayer(SandwichDecoderLayer):
    def __init__(self, config: dict, layer_type: str, qk_norm: bool = True) -> None:
        attention = Attention(
            config, layer_type, qkv_bias=bool(config.get("attention_bias", False)),
            o_bias=bool(config.get("attention_bias", False)), qk_norm=GemmaRMSNorm if qk_norm else None,
            scale=config.get("query_pre_attn_scalar", config.get("head_dim", 256)) ** -0.5,
            logit_soft_cap=config.get("attn_logit_softcapping"))
        mlp = GatedMLP(config["hidden_size"], config["intermediate_size"],
                       config.get("hidden_activation") or config.get("hidden_act", "gelu_pytorch_tanh"))
        super().__init__(config, attention, mlp, GemmaRMSNorm)


class Gemma3Model(DecoderModel):
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The reference scales by sqrt(hidden) rounded to the weights' dtype.
        return x * torch.tensor(self.embed_tokens.embedding_dim ** 0.5, dtype=x.dtype)


class Gemma3ForCausalLM(CausalLM):
    qk_norm = True  # Gemma 2: False
    sliding_window_pattern = 6  # every 6th layer global unless the config says otherwise (Gemma 2: 2)

    def __init__(self, config: dict) -> None:
        config = {"tie_word_embeddings": True, **config}
        super().__init__(config)
        layers = [Gemma3DecoderLayer(config, kind, self.qk_norm)
                  for kind in gemma3_layer_types(config, self.sliding_window_pattern)]
        self.model = Gemma3Model(config, layers, GemmaRMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6)))
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"])
        self.final_logit_softcapping = config.get("final_logit_softcapping")
        self.tie_weights()

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
