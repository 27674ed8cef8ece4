"""Qwen2 / Qwen2.5: the Llama block with bias on q, k and v (not on o)."""
from __future__ import annotations

from vllmpy.models.llama import Attention, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: dict, layer_type: str) -> Attention:
        return Attention(config, layer_type, qkv_bias=True, o_bias=False)
