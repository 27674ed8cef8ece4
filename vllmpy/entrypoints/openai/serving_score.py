"""POST /score (text_1 × text_2) and /rerank (query × documents, sorted, the best top_n kept), as vLLM's:
a cross-encoder reads each pair as one prompt, an embedding model scores by cosine (score_utils)."""
from __future__ import annotations

from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.entrypoints.openai.protocol_score import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from vllmpy.entrypoints.openai.serving_embedding import encode_all
from vllmpy.entrypoints.openai.serving_engine import ServingContext, random_id, usage_info
from vllmpy.entrypoints.openai.serving_pooling import refusal, succeeded
from vllmpy.entrypoints.score_utils import PairScorer, as_texts, check_scoring_task, pair_up
from vllmpy.pooling_params import PoolingParams

_FIELDS = ("text_1", "text_2", "truncate_prompt_tokens", "use_activation", "model")


async def create_score(ctx: ServingContext, request: ScoreRequest) -> ScoreResponse:
    ctx.check_base_model(request.model)
    request_id = random_id("score")
    scores = await _score(ctx, as_texts(request.text_1), as_texts(request.text_2), request, request_id,
                          ("text_1", "text_2"))
    data = [ScoreResponseData(index=i, score=score) for i, (score, _) in enumerate(scores)]
    return ScoreResponse(id=request_id, model=ctx.model_name, data=data,
                         usage=usage_info(sum(len(ids) for _, ids in scores), 0))


async def create_rerank(ctx: ServingContext, request: RerankRequest) -> RerankResponse:
    ctx.check_base_model(request.model)
    request_id = random_id("rerank")
    scores = await _score(ctx, [request.query], request.documents, request, request_id, ("query", "documents"))
    order = sorted(range(len(scores)), key=lambda i: scores[i][0], reverse=True)
    if request.top_n:
        order = order[:request.top_n]
    results = [RerankResult(index=i, relevance_score=scores[i][0],
                            document=RerankDocument(text=request.documents[i]) if request.return_documents else None)
               for i in order]
    tokens = sum(len(ids) for _, ids in scores)
    return RerankResponse(id=request_id, model=ctx.model_name, results=results,
                          usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens))


async def _score(ctx: ServingContext, text_1: list[str], text_2: list[str], request: ScoreRequest | RerankRequest,
                 request_id: str, names: tuple[str, str]) -> list[tuple[float, list[int]]]:
    """(score, prompt tokens) per pair; refusals name the route's fields (`names`: its text_1 / text_2)."""
    core = ctx.engine.engine.core
    renamed = dict(zip(("text_1", "text_2"), names))
    ctx.check_truncation(request.truncate_prompt_tokens)
    try:
        check_scoring_task(core.task)
        for name, texts in zip(names, (text_1, text_2)):  # refused before tokenizing, as ctx.encode does
            size = max(len(text.encode("utf-8")) for text in texts)
            if size > ctx.max_prompt_bytes:
                raise ValueError(f"{name}: a text of {size} bytes exceeds the maximum allowed prompt length of "
                                 f"{ctx.max_prompt_bytes} bytes")
        params = PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens,
                               use_activation=request.use_activation)
        scorer = PairScorer(core.task, ctx.tokenizer, pair_up(text_1, text_2), params)
        outputs = await encode_all(ctx, [p for p, _ in scorer.requests], [q for _, q in scorer.requests],
                                   request_id, request.priority)
    except ValueError as exc:
        error = refusal(exc, (*_FIELDS, *names), names[1])
        raise RequestError(error.message, renamed.get(error.param, error.param)) from exc
    return scorer.scores(succeeded(outputs))
