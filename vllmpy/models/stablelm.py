"""StableLM (2, Zephyr, Code): LayerNorm with bias, partial rotary (25%), gated SiLU MLP; optional
q/k/v bias (`use_qkv_bias`), per-head q/k LayerNorm (`qk_layernorm`, one norm per head in the
checkpoint) and parallel residual (`use_parallel_residual`)."""
from __future__ import annotations

import re

from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import LayerNorm, PerHeadLayerNorm
from vllmpy.models.base import CausalLM
from vllmpy.models.llama import Attention, DecoderLayer, DecoderModel, norm_eps

_HEAD_NORM = re.compile(r"\.self_attn\.([qk])_layernorm\.norms\.(\d+)\.")


class StableLmForCausalLM(CausalLM):
    def __init__(self, config: dict) -> None:
        config = {"layer_norm_eps": 1e-5, **config}
        super().__init__(config)
        hidden = config["hidden_size"]
        qk_norm = PerHeadLayerNorm if config.get("qk_layernorm") else None
        layers = [DecoderLayer(config, Attention(config, "full_attention", qkv_bias=bool(config.get("use_qkv_bias")),
                                                 o_bias=False, qk_norm=qk_norm, qk_norm_layout="per_head"),
                               norm=LayerNorm, parallel=bool(config.get("use_parallel_residual")))
                  for _ in range(config["num_hidden_layers"])]
        self.model = DecoderModel(config, layers, LayerNorm(hidden, norm_eps(config)))
        self.lm_head = Linear(hidden, config["vocab_size"])
        self.tie_weights()

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)

    def checkpoint_name_to_param(self, name: str) -> tuple[str, int | str | None]:
        """`self_attn.q_layernorm.norms.{h}.weight` is row h of our [heads, head_dim] q_norm weight."""
        if match := _HEAD_NORM.search(name):
            return name[:match.start()] + f".self_attn.{match[1]}_norm." + name[match.end():], int(match[2])
        return super().checkpoint_name_to_param(name)
