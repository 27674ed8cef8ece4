"""OLMo 2 and OLMo 3: no norm before attention or MLP, only after each (x + norm(attn(x)), then
x + norm(mlp(x))); RMSNorm on q and k over the whole projection, before the heads are split.
OLMo 3 adds sliding-window layers (three of every four) with a rope per layer type."""
from __future__ import annotations

from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import RMSNorm
from vllmpy.models.base import CausalLM
from vllmpy.models.llama import Attention, DecoderModel, GatedMLP, SandwichDecoderLayer, norm_eps


class Olmo2ForCausalLM(CausalLM):
    def __init__(self, config: dict) -> None:
        super().__init__(config)
        hidden = config["hidden_size"]
        layers = [SandwichDecoderLayer(
            config, self.make_attention(config, kind),
            GatedMLP(hidden, config["intermediate_size"], config.get("hidden_act", "silu")), pre_norms=False)
            for kind in self.layer_types(config)]
        self.model = DecoderModel(config, layers, RMSNorm(hidden, norm_eps(config)))
        self.lm_head = Linear(hidden, config["vocab_size"])
        self.tie_weights()

    def layer_types(self, config: dict) -> list[str]:
        return ["full_attention"] * config["num_hidden_layers"]

    def make_attention(self, config: dict, layer_type: str) -> Attention:
        bias = bool(config.get("attention_bias", False))
        return Attention(config, layer_type, qkv_bias=bias, o_bias=bias, qk_norm=RMSNorm, qk_norm_layout="flat")

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    def __init__(self, config: dict) -> None:
        scaling = config.get("rope_scaling")
        if scaling and not config.get("rope_parameters"):  # older configs: the scaling is the global layers' only
            theta = config.get("rope_theta", 10000.0)
            full = {**scaling, "rope_type": scaling.get("rope_type", scaling.get("type")), "rope_theta": theta}
            config = {**config, "rope_parameters": {"full_attention": full,
                                                    "sliding_attention": {"rope_type": "default", "rope_theta": theta}}}
        super().__init__(config)

    def layer_types(self, config: dict) -> list[str]:
        if config.get("layer_types"):
            return list(config["layer_types"])
        return ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                for i in range(config["num_hidden_layers"])]
