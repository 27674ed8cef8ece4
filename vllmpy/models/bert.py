"""BERT encoder (BertModel: sentence-transformers' all-MiniLM, BGE, E5, ...): bidirectional attention,
learned absolute positions, token-type embeddings (type 1 on a sentence pair's second segment), post-LayerNorm residual
blocks, ungated GELU MLP, biases everywhere. Reuses the shared attention (non-causal, no rotary) and MLP."""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from vllmpy.attention.base import AttentionMetadata
from vllmpy.layers.norm import LayerNorm
from vllmpy.models.adapters import PoolingModel
from vllmpy.models.base import CausalLM
from vllmpy.models.llama import MLP, Attention

# The next-sentence pooler head, which embedding pooling does not use (as vLLM).
_SKIPPED = ("pooler.",)


class BertEmbeddings(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.word_embeddings = nn.Embedding(config["vocab_size"], hidden)
        self.position_embeddings = nn.Embedding(config["max_position_embeddings"], hidden)
        self.token_type_embeddings = nn.Embedding(config.get("type_vocab_size", 2), hidden)
        for table in (self.word_embeddings, self.position_embeddings, self.token_type_embeddings):
            table.weight.requires_grad_(False)
        self.LayerNorm = LayerNorm(hidden, config.get("layer_norm_eps", 1e-12))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        types = self.token_type_embeddings.weight[0] if token_type_ids is None else self.token_type_embeddings(
            token_type_ids)
        return self.LayerNorm(x + types)


class BertLayer(nn.Module):
    """Post-norm: x = norm(x + attn(x)), then norm(x + mlp(x))."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("layer_norm_eps", 1e-12)
        self.self_attn = Attention(config, "full_attention", qkv_bias=True, o_bias=True, rope=False, causal=False)
        self.attention_norm = LayerNorm(hidden, eps)
        self.mlp = MLP(hidden, config["intermediate_size"], config.get("hidden_act", "gelu"))
        self.output_norm = LayerNorm(hidden, eps)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.attention_norm(x + self.self_attn(x, None, kv_cache, meta))
        return self.output_norm(x + self.mlp(x))


class BertModel(PoolingModel, CausalLM):
    default_pooling_type = "CLS"
    is_causal = False
    uses_token_types = True  # the runner passes token_type_ids (see layers.pooler.token_type_inputs)
    embeddings_class: type[nn.Module] = BertEmbeddings
    checkpoint_renames = (
        (r"^bert\.", ""),
        (r"^encoder\.layer\.", "layers."),
        (r"\.attention\.self\.query\.", ".self_attn.q_proj."),
        (r"\.attention\.self\.key\.", ".self_attn.k_proj."),
        (r"\.attention\.self\.value\.", ".self_attn.v_proj."),
        (r"\.attention\.output\.dense\.", ".self_attn.o_proj."),
        (r"\.attention\.output\.LayerNorm\.", ".attention_norm."),
        (r"\.intermediate\.dense\.", ".mlp.fc1."),
        (r"\.output\.dense\.", ".mlp.fc2."),
        (r"\.output\.LayerNorm\.", ".output_norm."),
    )

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.embeddings = self.embeddings_class(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config["num_hidden_layers"]))

    def set_max_model_len(self, max_model_len: int) -> None:
        positions = self.position_limit(self.config)
        if max_model_len > positions:
            raise ValueError(f"--max-model-len {max_model_len} exceeds the {positions} positions this model's "
                             f"max_position_embeddings covers: it has no learned position beyond that")
        super().set_max_model_len(max_model_len)

    @staticmethod
    def position_limit(config: dict) -> int:
        """The longest prompt the learned position table covers (the engine's max_model_len cap)."""
        return config["max_position_embeddings"]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: list[AttentionMetadata], token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer, kv_cache, layer_meta in zip(self.layers, kv_caches, meta):
            x = layer(x, kv_cache, layer_meta)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        prefix = self.checkpoint_renames[0][0]  # "bert." / "roberta."
        super().load_weights((name, tensor) for name, tensor in weights
                             if not re.sub(prefix, "", name).startswith(_SKIPPED))
