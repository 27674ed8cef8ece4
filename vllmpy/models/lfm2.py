"""LFM2 (Liquid): short-conv layers (`conv`) with a few attention layers (`full_attn_idxs` / `layer_types`).

Attention has per-head q/k RMSNorm (q_layernorm, k_layernorm) and full rotary; every layer has a gated
MLP (w1, w3, w2) whose width `block_auto_adjust_ff_dim` shrinks to 2/3, times block_ffn_dim_multiplier,
rounded up to block_multiple_of. The final norm is `embedding_norm`. Checkpoint names are mapped onto
the shared hybrid decoder's (operator_norm -> input_layernorm, conv -> linear_attn, ...).
"""
from __future__ import annotations

from torch import nn

from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.short_conv import ShortConv
from vllmpy.models.base import CausalLM
from vllmpy.models.hybrid import HybridDecoderLayer, HybridModel
from vllmpy.models.llama import Attention, GatedMLP


def lfm2_layer_types(config: dict) -> list[str]:
    """`layer_types`, else attention at `full_attn_idxs` (every layer when absent, as transformers) and conv."""
    if config.get("layer_types"):
        return list(config["layer_types"])
    full = config.get("full_attn_idxs")
    full = set(range(config["num_hidden_layers"]) if full is None else full)
    return ["full_attention" if i in full else "conv" for i in range(config["num_hidden_layers"])]


def ffn_width(config: dict) -> int:
    """The MLP width transformers builds (the checkpoint's w1 rows), not the config's intermediate_size."""
    width = config["intermediate_size"]
    if config.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = config.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = config.get("block_multiple_of", 256)
            width = multiple * -(-int(multiplier * width) // multiple)
    return width


class Lfm2ForCausalLM(CausalLM):
    packed_modules_mapping = {**CausalLM.packed_modules_mapping, "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1)}
    checkpoint_renames = (
        (r"\.operator_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.feed_forward\.w2\.", ".mlp.down_proj."), (r"\.feed_forward\.", ".mlp."),
        (r"\.conv\.(in_proj|out_proj|conv)\.", r".linear_attn.\1."),
        (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
        (r"\.self_attn\.([qk])_layernorm\.", r".self_attn.\1_norm."),
        (r"^model\.embedding_norm\.", "model.norm."),
    )

    def __init__(self, config: dict) -> None:
        config = {**config, "rms_norm_eps": config.get("norm_eps", 1e-5),
                  "tie_word_embeddings": config.get("tie_word_embeddings", config.get("tie_embedding", True))}
        super().__init__(config)
        hidden, width = config["hidden_size"], ffn_width(config)
        layers = [HybridDecoderLayer(config, self._mixer(config, kind), GatedMLP(hidden, width, "silu"), RMSNorm)
                  for kind in lfm2_layer_types(config)]
        self.model = HybridModel(config, layers, RMSNorm)
        self.lm_head = Linear(hidden, config["vocab_size"])
        self.tie_weights()

    @staticmethod
    def _mixer(config: dict, kind: str) -> nn.Module:
        if kind == "conv":
            return ShortConv(config["hidden_size"], config.get("conv_L_cache", 3), bool(config.get("conv_bias", False)))
        return Attention(config, kind, qkv_bias=False, o_bias=False, qk_norm=RMSNorm)

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)
