"""Phi (1, 1.5, 2): one LayerNorm feeding attention and MLP in parallel, x + attn(ln(x)) + mlp(ln(x));
partial rotary; biases everywhere (q/k/v, dense, fc1/fc2, and the untied head); gelu-tanh MLP;
optional per-head LayerNorm on q and k."""
from __future__ import annotations

from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import LayerNorm
from vllmpy.models.base import CausalLM
from vllmpy.models.llama import MLP, Attention, DecoderLayer, DecoderModel, norm_eps


class PhiForCausalLM(CausalLM):
    checkpoint_renames = (
        (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
        (r"\.self_attn\.([qk])_layernorm\.", r".self_attn.\1_norm."),
        (r"^model\.final_layernorm\.", "model.norm."),
    )

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        hidden, eps = config["hidden_size"], norm_eps(config, 1e-5)
        qk_norm = LayerNorm if config.get("qk_layernorm") else None
        layers = [DecoderLayer(config, Attention(config, "full_attention", qkv_bias=True, o_bias=True, qk_norm=qk_norm),
                               MLP(hidden, config["intermediate_size"], config.get("hidden_act", "gelu_new")),
                               norm=LayerNorm, parallel=True)
                  for _ in range(config["num_hidden_layers"])]
        self.model = DecoderModel(config, layers, LayerNorm(hidden, eps))
        self.lm_head = Linear(hidden, config["vocab_size"], bias=True)
        self.tie_weights()

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)
