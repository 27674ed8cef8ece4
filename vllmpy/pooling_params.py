"""vLLM's PoolingParams for pooling requests (embed, classify, score, encode): same field names, validated
at construction."""
from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify", "score", "encode")


@dataclass
class PoolingParams:
    """Per-request pooling controls.

    dimensions: keep the first N dimensions (Matryoshka models only), before normalization.
    normalize: L2-normalize the vector; None = the model's default (on, unless a sentence-transformers
    checkpoint lists no Normalize module).
    truncate_prompt_tokens: keep only the last N prompt tokens (-1: max_model_len); a text prompt keeps
    its special tokens, as vLLM's left truncation does.
    task: what the request wants from the pooled state (POOLING_TASKS); None = the model's own.
    use_activation: classify / score: softmax or sigmoid on the logits (None = on); off returns raw logits.
    extra_kwargs: {"compressed_token_type_ids": n} marks a sentence pair whose second segment starts at
    token n (BERT's token type 1), as vLLM passes it.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None
    use_activation: bool | None = None
    extra_kwargs: dict | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
        if self.truncate_prompt_tokens is not None and not (
                self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1):
            raise ValueError(f"truncate_prompt_tokens must be -1 (max_model_len) or >= 1, "
                             f"got {self.truncate_prompt_tokens}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
