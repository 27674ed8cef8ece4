"""GPT-2: learned absolute positions, pre-LayerNorm blocks, ungated gelu-tanh MLP, biases everywhere,
tied head. Its Conv1D layers store weights as [in, out], the transpose of a Linear: they are turned
around at load. q/k/v arrive fused (`c_attn`) and load whole into qkv_proj."""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import LayerNorm
from vllmpy.models.base import CausalLM
from vllmpy.models.llama import MLP, Attention, DecoderLayer, DecoderModel

_CONV1D_WEIGHT = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$")
_MASK_BUFFER = re.compile(r"\.attn\.(masked_)?bias$")  # causal-mask buffers in older checkpoints


def _standard_config(config: dict) -> dict:
    """GPT-2's config.json names (n_embd, ...) as the common keys; GGUF configs already use those."""
    def get(key: str, gpt2_key: str):
        return config[gpt2_key] if gpt2_key in config else config[key]

    hidden = get("hidden_size", "n_embd")
    return {"tie_word_embeddings": True, **config, "hidden_size": hidden,
            "num_attention_heads": get("num_attention_heads", "n_head"),
            "num_hidden_layers": get("num_hidden_layers", "n_layer"),
            "max_position_embeddings": get("max_position_embeddings", "n_positions"),
            "intermediate_size": config.get("n_inner") or config.get("intermediate_size") or 4 * hidden,
            "layer_norm_epsilon": config.get("layer_norm_epsilon", 1e-5)}


class GPT2LMHeadModel(CausalLM):
    checkpoint_renames = (
        (r"^(transformer\.)?h\.", "model.layers."),
        (r"^(transformer\.)?wte\.", "model.embed_tokens."),
        (r"^(transformer\.)?wpe\.", "model.embed_positions."),
        (r"^(transformer\.)?ln_f\.", "model.norm."),
        (r"\.ln_1\.", ".input_layernorm."),
        (r"\.ln_2\.", ".post_attention_layernorm."),
        (r"\.attn\.c_attn\.", ".self_attn.qkv_proj."),
        (r"\.attn\.c_proj\.", ".self_attn.o_proj."),
        (r"\.mlp\.c_fc\.", ".mlp.fc1."),
        (r"\.mlp\.c_proj\.", ".mlp.fc2."),
    )

    def __init__(self, config: dict) -> None:
        config = _standard_config(config)
        super().__init__(config)
        hidden, eps = config["hidden_size"], config["layer_norm_epsilon"]
        head_dim = hidden // config["num_attention_heads"]
        layers = []
        for i in range(config["num_hidden_layers"]):
            scale = head_dim ** -0.5 if config.get("scale_attn_weights", True) else 1.0
            if config.get("scale_attn_by_inverse_layer_idx"):
                scale /= i + 1
            attention = Attention(config, "full_attention", qkv_bias=True, o_bias=True, scale=scale, rope=False)
            mlp = MLP(hidden, config["intermediate_size"], config.get("activation_function", "gelu_new"))
            layers.append(DecoderLayer(config, attention, mlp, norm=LayerNorm))
        self.model = DecoderModel(config, layers, LayerNorm(hidden, eps),
                                  learned_positions=config["max_position_embeddings"])
        self.lm_head = Linear(hidden, config["vocab_size"])
        self.tie_weights()

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, tensor.t() if _CONV1D_WEIGHT.search(name) else tensor)
                             for name, tensor in weights if not _MASK_BUFFER.search(name))
