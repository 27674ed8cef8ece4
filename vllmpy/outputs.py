"""Results handed to users, with vLLM's field names."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One generated or prompt position: {token_id: Logprob}
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    # Speculative decoding, over the request's sequences: draft tokens verified, and those accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        if self.first_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """One pooled prompt, vLLM's shape; `error` is set (and the embedding empty) if the engine failed it."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None


@dataclass
class PoolingOutput:
    data: Any  # torch.Tensor: the pooler's output (an embedding, or a classifier's activated logits)


@dataclass
class ClassificationOutput:
    probs: list[float]  # the activated logits, one per label (raw logits with use_activation=False)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float  # a cross-encoder's activated logit, or the cosine similarity of two embeddings


@dataclass
class PoolingRequestOutput:
    """LLM.encode's result, vLLM's shape; LLM.classify and LLM.score return the subclasses below."""

    request_id: str
    outputs: PoolingOutput | ClassificationOutput | ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    outputs: ClassificationOutput


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    outputs: ScoringOutput
