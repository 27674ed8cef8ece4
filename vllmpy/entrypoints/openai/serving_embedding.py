"""POST /v1/embeddings: one vector per input (text or token ids), as floats or base64, in OpenAI's shape."""
from __future__ import annotations

import asyncio
import base64
import struct
from http import HTTPStatus

from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.entrypoints.openai.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse
from vllmpy.entrypoints.openai.serving_engine import ServingContext, random_id, usage_info
from vllmpy.outputs import EmbeddingRequestOutput
from vllmpy.pooling_params import PoolingParams

# Engine and PoolingParams refusals start with the field at fault; anything else is about the input.
_FIELDS = ("dimensions", "truncate_prompt_tokens", "model")


async def create_embedding(ctx: ServingContext, request: EmbeddingRequest) -> EmbeddingResponse:
    ctx.check_base_model(request.model)
    request_id = random_id("embd")
    try:
        params = PoolingParams(task="embed", dimensions=request.dimensions, normalize=request.normalize,
                               truncate_prompt_tokens=request.truncate_prompt_tokens)
        prompts = engine_prompts(ctx, request)
        outputs = await encode_all(ctx, prompts, params, request_id, request.priority)
    except ValueError as exc:
        raise RequestError(str(exc), _param_of(str(exc))) from exc
    data = []
    for i, output in enumerate(outputs):
        if output.error is not None:
            raise RequestError(f"embedding failed inside the engine: {output.error}", None,
                               HTTPStatus.INTERNAL_SERVER_ERROR)
        data.append(EmbeddingData(index=i, embedding=encode_vector(output.outputs.embedding, request.encoding_format)))
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return EmbeddingResponse(id=request_id, model=ctx.model_name, data=data, usage=usage_info(num_tokens, 0))


def engine_prompts(ctx: ServingContext, request: EmbeddingRequest) -> list[dict]:
    """Each input as engine prompt; texts are tokenized here (truncated from the left, keeping the
    special tokens, when truncate_prompt_tokens asks), token ids go as they are."""
    value = request.input
    items = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else list(value)
    if not items or any(len(item) == 0 for item in items):
        raise RequestError("input must not be empty, nor contain an empty string or token list", "input")
    truncate = request.truncate_prompt_tokens
    ctx.check_truncation(truncate)
    truncate = ctx.max_model_len if truncate == -1 else truncate
    prompts = []
    for item in items:
        if isinstance(item, list):
            prompts.append({"prompt_token_ids": item})
        elif truncate is None:
            prompts.append({"prompt": item, "prompt_token_ids": ctx.encode(item, request.add_special_tokens, "input")})
        else:
            ids = ctx.tokenizer.encode(item, request.add_special_tokens, truncate_to=truncate)
            prompts.append({"prompt": item, "prompt_token_ids": ids})
    return prompts


async def encode_all(ctx: ServingContext, prompts: list[dict], params: PoolingParams | list[PoolingParams],
                     request_id: str, priority: int) -> list[EmbeddingRequestOutput]:
    """Submit every input at once (`params`: shared, or one per prompt); one refusal (or the client
    leaving) aborts the rest."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    tasks = [asyncio.ensure_future(ctx.engine.encode(p, q, f"{request_id}-{i}", priority))
             for i, (p, q) in enumerate(zip(prompts, each))]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: little-endian float32 bytes
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def _param_of(message: str) -> str:
    word = message.split(" ", 1)[0].rstrip(":")
    return word if word in _FIELDS else "input"
