"""Sequence classifiers and cross-encoders: an encoder or decoder whose pooled state goes through a
classification head (`classify(pooled) -> logits`), which the engine's Pooler applies.

- BertForSequenceClassification: CLS → BERT's pooler (dense + tanh) → classifier (ms-marco cross-encoders).
- (XLM)RobertaForSequenceClassification: CLS → classifier.dense + tanh → classifier.out_proj (BGE rerankers).
- *ForSequenceClassification of a decoder family (Qwen3 rerankers, ...): the last token → `score` (no bias).
"""
from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from vllmpy.layers.linear import Linear
from vllmpy.layers.pooler import num_labels
from vllmpy.models.adapters import as_embedding_model
from vllmpy.models.base import CausalLM
from vllmpy.models.bert import BertModel
from vllmpy.models.roberta import RobertaModel


class _DenseTanh(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = Linear(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x))


class BertForSequenceClassification(BertModel):
    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.pooler = _DenseTanh(config["hidden_size"])
        self.classifier = Linear(config["hidden_size"], num_labels(config), bias=True)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pooler(pooled))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        CausalLM.load_weights(self, weights)  # the pooler is part of the head here: nothing is skipped


class _RobertaHead(nn.Module):
    def __init__(self, hidden: int, labels: int) -> None:
        super().__init__()
        self.dense = Linear(hidden, hidden, bias=True)
        self.out_proj = Linear(hidden, labels, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class RobertaForSequenceClassification(RobertaModel):
    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.classifier = _RobertaHead(config["hidden_size"], num_labels(config))

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(pooled)


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    """The same network; XLM-R differs in its tokenizer and vocabulary only."""


@functools.cache  # one class per family, so isinstance and repeated loads agree
def as_seq_cls_model(cls: type[CausalLM]) -> type[CausalLM]:
    """A decoder family as transformers' *ForSequenceClassification: no LM head, the last token's hidden
    state through `score` (vLLM's as_seq_cls_model)."""

    class SequenceClassifier(as_embedding_model(cls)):
        def __init__(self, config: dict) -> None:
            super().__init__(config)
            self.score = Linear(config["hidden_size"], num_labels(config))

        def classify(self, pooled: torch.Tensor) -> torch.Tensor:
            return self.score(pooled)

    SequenceClassifier.__name__ = SequenceClassifier.__qualname__ = f"{cls.__name__}AsSequenceClassifier"
    return SequenceClassifier
