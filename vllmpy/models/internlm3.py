"""InternLM 3: the Llama block under InternLM's config names (`qkv_bias` for the attention
projections, `bias` for the MLP). transformers runs it as Llama, with one bias switch for q, k, v and
o, and refuses checkpoints whose two switches differ; so do we."""
from __future__ import annotations

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.models.llama import LlamaForCausalLM


class InternLM3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: dict) -> None:
        qkv_bias = bool(config.get("qkv_bias", config.get("attention_bias", False)))
        bias = bool(config.get("bias", config.get("mlp_bias", False)))
        if qkv_bias != bias:
            raise UnsupportedCheckpointError(
                f"InternLM3 config has qkv_bias={qkv_bias} but bias={bias}; only equal values are supported "
                "(the attention output projection takes one of them, and the reference implementation "
                "does not say which)")
        super().__init__({**config, "attention_bias": qkv_bias, "mlp_bias": bias})
