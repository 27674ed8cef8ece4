"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with Qwen2-MoE's sparse layers, no shared expert.

A sliding window, when `use_sliding_window` turns it on, applies to every layer.
"""
from __future__ import annotations

from vllmpy.models.qwen2_moe import Qwen2MoeForCausalLM
from vllmpy.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    all_sliding = True
    make_attention = Qwen3ForCausalLM.make_attention

    def __init__(self, config: dict) -> None:
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        super().__init__({**config, "sliding_window": window})
