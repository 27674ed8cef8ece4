"""GLM-4 (0414): norms on both sides of attention and MLP; rotary on half of each head
(partial_rotary_factor 0.5 unless stated) in the interleaved GPT-J pair layout; bias on q/k/v only;
gate/up stored fused in the checkpoint (`gate_up_proj`, loaded as it is)."""
from __future__ import annotations

from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import RMSNorm
from vllmpy.models.base import CausalLM
from vllmpy.models.llama import Attention, DecoderModel, GatedMLP, SandwichDecoderLayer, norm_eps


def with_half_rotary(config: dict) -> dict:
    """GLM's default partial_rotary_factor 0.5 where the config states none (older config.json files)."""
    rope = config.get("rope_parameters") or {}
    if "partial_rotary_factor" not in rope and "partial_rotary_factor" not in config:
        return {**config, "partial_rotary_factor": 0.5}
    return config


class Glm4ForCausalLM(CausalLM):
    # GLM-4's names for the sandwich norms; renamed in this order, post_attention_layernorm (before the
    # MLP here) first.
    checkpoint_renames = (
        (r"\.post_attention_layernorm\.", ".pre_feedforward_layernorm."),
        (r"\.post_self_attn_layernorm\.", ".post_attention_layernorm."),
        (r"\.post_mlp_layernorm\.", ".post_feedforward_layernorm."),
    )

    def __init__(self, config: dict) -> None:
        config = with_half_rotary(config)
        super().__init__(config)
        hidden = config["hidden_size"]
        layers = [SandwichDecoderLayer(
            config, Attention(config, "full_attention", qkv_bias=bool(config.get("attention_bias", True)),
                              o_bias=False),
            GatedMLP(hidden, config["intermediate_size"], config.get("hidden_act", "silu")))
            for _ in range(config["num_hidden_layers"])]
        self.model = DecoderModel(config, layers, RMSNorm(hidden, norm_eps(config)), rope_interleaved=True)
        self.lm_head = Linear(hidden, config["vocab_size"])
        self.tie_weights()

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)
