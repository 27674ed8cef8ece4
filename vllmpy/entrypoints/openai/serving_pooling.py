"""POST /pooling: the pooler's output for each input (an embedding, or a classifier's activated logits),
as vLLM's; and what the pooling routes (/pooling, /classify, /score, /rerank) share."""
from __future__ import annotations

from http import HTTPStatus

from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.entrypoints.openai.protocol_score import PoolingRequest, PoolingResponse, PoolingResponseData
from vllmpy.entrypoints.openai.serving_embedding import encode_all, encode_vector, engine_prompts
from vllmpy.entrypoints.openai.serving_engine import ServingContext, random_id, usage_info
from vllmpy.outputs import EmbeddingRequestOutput
from vllmpy.pooling_params import PoolingParams

_FIELDS = ("dimensions", "normalize", "truncate_prompt_tokens", "use_activation", "model")


async def create_pooling(ctx: ServingContext, request: PoolingRequest) -> PoolingResponse:
    ctx.check_base_model(request.model)
    request_id = random_id("pool")
    try:
        params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize,
                               truncate_prompt_tokens=request.truncate_prompt_tokens,
                               use_activation=request.use_activation)
        outputs = await encode_all(ctx, engine_prompts(ctx, request), params, request_id, request.priority)
    except ValueError as exc:
        raise refusal(exc, _FIELDS, "input") from exc
    data = [PoolingResponseData(index=i, data=encode_vector(o.outputs.embedding, request.encoding_format))
            for i, o in enumerate(succeeded(outputs))]
    return PoolingResponse(id=request_id, model=ctx.model_name, data=data,
                           usage=usage_info(sum(len(o.prompt_token_ids) for o in outputs), 0))


def refusal(exc: ValueError, fields: tuple[str, ...], default: str) -> RequestError:
    """Engine and PoolingParams refusals start with the field at fault; anything else is about `default`."""
    word = str(exc).split(" ", 1)[0].rstrip(":")
    return RequestError(str(exc), word if word in fields else default)


def succeeded(outputs: list[EmbeddingRequestOutput]) -> list[EmbeddingRequestOutput]:
    """A prompt the engine failed (not the client's fault) is a 500 naming the cause."""
    for output in outputs:
        if output.error is not None:
            raise RequestError(f"pooling failed inside the engine: {output.error}", None,
                               HTTPStatus.INTERNAL_SERVER_ERROR)
    return outputs
