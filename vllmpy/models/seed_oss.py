"""Seed-OSS: the Llama block with q/k/v bias (`attention_bias`, on by default) and a separate switch
for the output projection's bias (`attention_out_bias`, off by default)."""
from __future__ import annotations

from vllmpy.models.llama import Attention, LlamaForCausalLM


class SeedOssForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: dict, layer_type: str) -> Attention:
        return Attention(config, layer_type, qkv_bias=bool(config.get("attention_bias", True)),
                         o_bias=bool(config.get("attention_out_bias", False)))
