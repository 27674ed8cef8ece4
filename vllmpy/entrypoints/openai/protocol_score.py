"""Request and response bodies of /score, /rerank (Jina / Cohere shapes), /classify and /pooling, with
vLLM's field names."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, Field

from vllmpy.entrypoints.openai.protocol import (
    EmbeddingRequest,
    Int,
    NonEmptyText,
    NonNegative,
    PromptInput,
    RequestBody,
    UsageInfo,
    _now,
    _omitted_when_none,
)

ScoreTexts = Union[NonEmptyText, Annotated[list[NonEmptyText], Field(min_length=1)]]


# ---------------------------------------------------------------- requests


class ScoreRequest(RequestBody):
    """text_1 against text_2: one to one, one to many, or many to many (pairwise), as vLLM."""

    model: str | None = None
    text_1: ScoreTexts
    text_2: ScoreTexts
    truncate_prompt_tokens: Int | None = None  # embedding models only: each text keeps its last N tokens
    use_activation: bool | None = None  # False: a cross-encoder's raw logit
    priority: Int = 0


class RerankRequest(RequestBody):
    """Jina's and Cohere's rerank: documents sorted by relevance to the query, the best top_n kept."""

    model: str | None = None
    query: NonEmptyText
    documents: Annotated[list[NonEmptyText], Field(min_length=1)]
    top_n: NonNegative = 0  # 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: Int | None = None
    use_activation: bool | None = None
    priority: Int = 0


class ClassificationRequest(RequestBody):
    model: str | None = None
    input: PromptInput
    truncate_prompt_tokens: Int | None = None
    add_special_tokens: bool = True
    use_activation: bool | None = None  # False: raw logits
    user: str | None = None
    priority: Int = 0


class PoolingRequest(EmbeddingRequest):
    """/v1/embeddings' fields; the answer is the pooler's output, whatever the model's task."""

    use_activation: bool | None = None


# ---------------------------------------------------------------- responses


class ScoreResponseData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ListResponse(BaseModel):
    """What /score, /classify and /pooling answers share; each adds its `data` list."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    usage: UsageInfo


class ScoreResponse(ListResponse):
    data: list[ScoreResponseData]


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = _omitted_when_none()  # left out with return_documents=false
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(ListResponse):
    data: list[ClassificationData]


class PoolingResponseData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str  # str: base64 of the little-endian float32 bytes


class PoolingResponse(ListResponse):
    data: list[PoolingResponseData]
