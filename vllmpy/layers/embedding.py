"""Token embedding tables, dense or kept in GGML blocks (a lookup decodes only the gathered rows)."""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.layers.linear import release
from vllmpy.layers.quantized import PackedTensor


class VocabEmbedding(nn.Embedding):
    """nn.Embedding that can hold its table packed; a tied LM head then computes on the same blocks."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        # An empty table (the checkpoint fills it): random init would cost ~1 s on the meta device, where
        # torch's first normal_ loads its Python decompositions.
        super().__init__(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
        self.weight.requires_grad_(False)
        self.packed: PackedTensor | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return super().forward(input_ids)
        return self.packed.rows(input_ids).to(self.weight.dtype)

    def load_packed(self, table: PackedTensor, shard_id: int | str | None = None) -> None:
        if table.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"shape mismatch: parameter {(self.num_embeddings, self.embedding_dim)} "
                             f"vs checkpoint {table.shape}")
        self.packed = table
        release(self.weight)
