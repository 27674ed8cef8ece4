"""Embedding models: the marker the engine reads, and a decoder family turned into one (vLLM's
as_embedding_model): the same blocks, no LM head; the runner pools the final hidden states."""
from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from vllmpy.models.base import CausalLM


class PoolingModel:
    """Mixin (listed before CausalLM) of models that embed rather than generate: no LM head."""

    default_pooling_type = "LAST"  # unless a sentence-transformers config says otherwise
    is_causal = True  # False: an encoder; its prompts are computed whole, in one step, uncached

    def tie_weights(self) -> None:
        pass  # no head to tie

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} is an embedding model: it has no LM head")


@functools.cache  # one class per family, so isinstance and repeated loads agree
def as_embedding_model(cls: type[CausalLM], checkpoint_prefix: str = "") -> type[CausalLM]:
    """`cls` without its LM head. `checkpoint_prefix` is prepended to tensor names that lack it: bare
    `LlamaModel` checkpoints name `layers.0...` what the causal LM calls `model.layers.0...`."""

    class EmbeddingModel(PoolingModel, cls):
        def __init__(self, config: dict) -> None:
            super().__init__(config)
            del self.lm_head  # never used; built on the meta device, so nothing was allocated

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            super().load_weights(
                (name if name.startswith(checkpoint_prefix) else checkpoint_prefix + name, tensor)
                for name, tensor in weights if not name.startswith("lm_head."))

    EmbeddingModel.__name__ = EmbeddingModel.__qualname__ = f"{cls.__name__}AsEmbedding"
    return EmbeddingModel
