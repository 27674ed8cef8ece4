"""vLLM's PoolingParams for embedding requests: same field names, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """Per-request embedding controls.

    dimensions: keep the first N dimensions (Matryoshka models only), before normalization.
    normalize: L2-normalize the vector; None = the model's default (on, unless a sentence-transformers
    checkpoint lists no Normalize module).
    truncate_prompt_tokens: keep only the last N prompt tokens (-1: max_model_len); a text prompt keeps
    its special tokens, as vLLM's left truncation does.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
        if self.truncate_prompt_tokens is not None and not (
                self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1):
            raise ValueError(f"truncate_prompt_tokens must be -1 (max_model_len) or >= 1, "
                             f"got {self.truncate_prompt_tokens}")
