"""EXAONE 4: OLMo 2's post-norm block (x + norm(attn(x)), x + norm(mlp(x))) with per-head q/k RMSNorm.
With a sliding window, layers follow `sliding_window_pattern` (3 local : 1 global for "LLLG" or 4) and
only the local layers apply rotary: the global ones are NoPE. Without one, every layer is global with rope."""
from __future__ import annotations

from vllmpy.layers.norm import RMSNorm
from vllmpy.models.llama import Attention
from vllmpy.models.olmo2 import Olmo2ForCausalLM


def exaone4_layer_types(config: dict) -> list[str]:
    """`layer_types`, else from `sliding_window_pattern`: an int n (every n-th layer global) or a string
    of L (local) and G (global) repeated over the layers."""
    n = config["num_hidden_layers"]
    if config.get("layer_types"):
        return list(config["layer_types"])
    pattern = config.get("sliding_window_pattern")
    if not config.get("sliding_window") or not pattern:
        return ["full_attention"] * n
    if isinstance(pattern, str):
        return ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(n)]
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


class Exaone4ForCausalLM(Olmo2ForCausalLM):
    def layer_types(self, config: dict) -> list[str]:
        return exaone4_layer_types(config)

    def make_attention(self, config: dict, layer_type: str) -> Attention:
        rope = not config.get("sliding_window") or layer_type == "sliding_attention"
        return Attention(config, layer_type, qkv_bias=False, o_bias=False, qk_norm=RMSNorm, rope=rope)
