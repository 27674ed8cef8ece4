"""OPT: learned positions read at position + 2 (the table's first two rows are padding), LayerNorm,
ReLU MLP (fc1/fc2) with biases, tied head. `do_layer_norm_before=False` (OPT-350m) normalises after
each residual add instead of before; `word_embed_proj_dim` < hidden adds project_in / project_out
around the decoder."""
from __future__ import annotations

import functools

import torch
from torch import nn

from vllmpy.layers.embedding import VocabEmbedding
from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import LayerNorm
from vllmpy.models.base import CausalLM
from vllmpy.models.llama import MLP, Attention, DecoderLayer, DecoderModel

POSITION_OFFSET = 2


class OPTPostNormLayer(DecoderLayer):
    """OPT-350m: x = ln(x + attn(x)), then x = ln(x + mlp(x))."""

    def forward(self, x, cos_sin, kv_cache, meta):
        x = self.input_layernorm(x + self.self_attn(x, cos_sin, kv_cache, meta))
        return self.post_attention_layernorm(x + self.mlp(x))


class OPTModel(DecoderModel):
    def __init__(self, config: dict, layers: list[nn.Module], norm: nn.Module) -> None:
        super().__init__(config, layers, norm, learned_positions=config["max_position_embeddings"] + POSITION_OFFSET,
                         position_offset=POSITION_OFFSET)
        hidden, proj = config["hidden_size"], config.get("word_embed_proj_dim") or config["hidden_size"]
        self.embed_tokens = VocabEmbedding(config["vocab_size"], proj)
        self.project_in = Linear(proj, hidden) if proj != hidden else None
        self.project_out = Linear(hidden, proj) if proj != hidden else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.project_in is None else self.project_in(x)

    def forward(self, input_ids, positions, kv_caches, meta):
        x = super().forward(input_ids, positions, kv_caches, meta)
        return x if self.project_out is None else self.project_out(x)


class OPTForCausalLM(CausalLM):
    checkpoint_renames = (
        (r"^model\.decoder\.final_layer_norm\.", "model.norm."),
        (r"^(model\.)?decoder\.", "model."),
        (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
        (r"\.self_attn_layer_norm\.", ".input_layernorm."),
        (r"\.final_layer_norm\.", ".post_attention_layernorm."),
        (r"\.(fc1|fc2)\.", r".mlp.\1."),
    )

    def __init__(self, config: dict) -> None:
        config = {"tie_word_embeddings": True, "layer_norm_eps": 1e-5, **config}  # nn.LayerNorm's eps
        super().__init__(config)
        hidden, bias = config["hidden_size"], bool(config.get("enable_bias", True))
        norm = functools.partial(LayerNorm, affine=bool(config.get("layer_norm_elementwise_affine", True)))
        pre_norm = bool(config.get("do_layer_norm_before", True))
        layer_cls = DecoderLayer if pre_norm else OPTPostNormLayer
        layers = [layer_cls(config, Attention(config, "full_attention", qkv_bias=bias, o_bias=bias, rope=False),
                            MLP(hidden, config["ffn_dim"], config.get("activation_function", "relu"), bias), norm=norm)
                  for _ in range(config["num_hidden_layers"])]
        final_norm = nn.Identity()
        if pre_norm and not config.get("_remove_final_layer_norm"):
            final_norm = norm(hidden, config["layer_norm_eps"])
        self.model = OPTModel(config, layers, final_norm)
        self.lm_head = Linear(config.get("word_embed_proj_dim") or hidden, config["vocab_size"])
        self.tie_weights()

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)
