"""Gemma (1) and Gemma 2.

Gemma: the Llama block with Gemma RMSNorm (1 + w), embeddings scaled by sqrt(hidden), a tied head, and
gelu-tanh (old configs say "gelu" but mean the tanh approximation, as transformers reads them).
Gemma 2: Gemma 3's block (norms before and after attention and MLP, attention and final logit
soft-capping, query_pre_attn_scalar) without q/k norm and with sliding/global layers alternating.
"""
from __future__ import annotations

from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import GemmaRMSNorm
from vllmpy.models.base import CausalLM
from vllmpy.models.gemma3 import Gemma3ForCausalLM, Gemma3Model
from vllmpy.models.llama import Attention, DecoderLayer, GatedMLP, layer_types, norm_eps


class GemmaForCausalLM(CausalLM):
    def __init__(self, config: dict) -> None:
        config = {"tie_word_embeddings": True, **config}
        super().__init__(config)
        hidden, eps = config["hidden_size"], norm_eps(config)
        act = config.get("hidden_act") or "gelu_pytorch_tanh"
        act = "gelu_pytorch_tanh" if act == "gelu" else act  # transformers' reading of the legacy name
        bias = bool(config.get("attention_bias", False))
        layers = [DecoderLayer(config, Attention(config, kind, qkv_bias=bias, o_bias=bias),
                               GatedMLP(hidden, config["intermediate_size"], act), norm=GemmaRMSNorm)
                  for kind in layer_types(config, all_sliding=False)]
        self.model = Gemma3Model(config, layers, GemmaRMSNorm(hidden, eps))
        self.lm_head = Linear(hidden, config["vocab_size"])
        self.tie_weights()

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    qk_norm = False
    sliding_window_pattern = 2  # even layers slide, odd layers attend globally

    def __init__(self, config: dict) -> None:
        # transformers' defaults when a config leaves the caps out (null turns them off)
        super().__init__({"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                          "query_pre_attn_scalar": 256, **config})
