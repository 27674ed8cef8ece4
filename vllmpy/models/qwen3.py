"""Qwen3: the Llama block with per-head RMSNorm on q and k before rotary."""
from __future__ import annotations

from vllmpy.layers.norm import RMSNorm
from vllmpy.models.llama import Attention, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: dict, layer_type: str) -> Attention:
        bias = bool(config.get("attention_bias", False))
        return Attention(config, layer_type, qkv_bias=bias, o_bias=bias, qk_norm=RMSNorm)
