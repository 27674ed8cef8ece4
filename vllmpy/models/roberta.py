"""RoBERTa / XLM-RoBERTa encoders (RobertaModel, XLMRobertaModel: BGE-M3, multilingual-e5, ...): BERT's
blocks with RoBERTa's positions, which start after the padding index (position i reads row
padding_idx + 1 + i, so a 514-row table covers 512 tokens), and a single token type."""
from __future__ import annotations

import torch

from vllmpy.models.bert import BertEmbeddings, BertModel


class RobertaEmbeddings(BertEmbeddings):
    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.position_offset = config.get("pad_token_id", 1) + 1

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(input_ids, positions + self.position_offset)


class RobertaModel(BertModel):
    uses_token_types = False  # type_vocab_size 1: every token is type 0
    embeddings_class = RobertaEmbeddings
    checkpoint_renames = ((r"^roberta\.", ""), *BertModel.checkpoint_renames[1:])

    @staticmethod
    def position_limit(config: dict) -> int:
        return config["max_position_embeddings"] - config.get("pad_token_id", 1) - 1


class XLMRobertaModel(RobertaModel):
    """The same network; XLM-R differs in its tokenizer and vocabulary only."""
