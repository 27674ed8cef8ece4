"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama block, with q/k/v and gate/up stored fused in the checkpoint
(`qkv_proj`, `gate_up_proj`, loaded as they are), every layer sliding when sliding_window is set,
optional partial rotary, and LongRoPE ("su" / "longrope") scaling for the long-context variants."""
from __future__ import annotations

from vllmpy.models.llama import MistralForCausalLM


class Phi3ForCausalLM(MistralForCausalLM):
    def __init__(self, config: dict) -> None:
        super().__init__(_standard_rope(config))


def _standard_rope(config: dict) -> dict:
    """Older configs name LongRoPE "su" (or "yarn", which Phi-3 always meant as LongRoPE, as transformers
    reads it) and keep original_max_position_embeddings at the top level."""
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    scaling = dict(config.get(key) or {})
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("su", "yarn", "longrope"):
        return config
    scaling["rope_type"] = "longrope"
    scaling.setdefault("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    if key == "rope_scaling":
        scaling.setdefault("rope_theta", config.get("rope_theta", 10000.0))
        scaling.setdefault("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return {**config, "rope_parameters": scaling}
