"""POST /v1/chat/completions: messages rendered by the chat template, n choices, whole or streamed."""
from __future__ import annotations

from collections.abc import AsyncIterator

from vllmpy.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs
from vllmpy.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from vllmpy.entrypoints.openai.serving_engine import EngineStream, ServingContext, check_finished, random_id, usage_info
from vllmpy.outputs import CompletionOutput


async def create_chat_completion(ctx: ServingContext, request: ChatCompletionRequest
                                 ) -> ChatCompletionResponse | AsyncIterator[ChatCompletionStreamResponse]:
    request.check()
    ctx.check_model(request.model)
    text = ctx.render_chat(request)
    token_ids = ctx.encode(text, request.add_special_tokens, "messages")
    max_tokens_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(request, max_tokens_field)
    # Engine messages name SamplingParams' fields; these are the chat request's names for them.
    renames = {"prompt": "messages", "max_tokens": max_tokens_field, "logprobs": "top_logprobs"}
    ctx.check_max_tokens(len(token_ids), max_tokens, max_tokens_field)
    params = ctx.sampling_params(request, max_tokens=max_tokens,
                                 logprobs=(request.top_logprobs or 0) if request.logprobs else None,
                                 prompt_logprobs=request.prompt_logprobs, renames=renames)
    request_id = random_id("chatcmpl")
    stream = await ctx.start({"prompt": text, "prompt_token_ids": token_ids}, params, request, request_id,
                             delta=request.stream, renames=renames)
    if request.stream:
        return _stream(ctx, request, request_id, stream)
    return await _collect(ctx, request, request_id, stream)


def _logprobs(request: ChatCompletionRequest, completion: CompletionOutput) -> ChatLogprobs | None:
    if not request.logprobs:
        return None
    return chat_logprobs(completion.token_ids, completion.logprobs or [], request.top_logprobs or 0)


async def _collect(ctx: ServingContext, request: ChatCompletionRequest, request_id: str,
                   stream: EngineStream) -> ChatCompletionResponse:
    final = None
    try:
        async for final in stream:
            pass
    finally:
        await stream.aclose()
    check_finished(final)
    choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text), logprobs=_logprobs(request, c),
                          finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in final.outputs]
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    return ChatCompletionResponse(
        id=request_id, model=ctx.model_name, choices=choices,
        usage=usage_info(len(final.prompt_token_ids), completion_tokens),
        # One rendered prompt serves every choice, so its logprobs sit beside the choices (as vLLM).
        prompt_logprobs=prompt_logprobs(final.prompt_logprobs) if request.prompt_logprobs is not None else None)


async def _stream(ctx: ServingContext, request: ChatCompletionRequest, request_id: str,
                  stream: EngineStream) -> AsyncIterator[ChatCompletionStreamResponse]:
    prompt_tokens = 0
    completion_tokens: dict[int, int] = {}
    finished: set[int] = set()

    def chunk(choice: ChatStreamChoice) -> ChatCompletionStreamResponse:
        usage = usage_info(prompt_tokens, sum(completion_tokens.values())) if request.continuous_usage else None
        return ChatCompletionStreamResponse(id=request_id, model=ctx.model_name, choices=[choice], usage=usage)

    try:
        async for output in stream:
            check_finished(output)
            prompt_tokens = len(output.prompt_token_ids)
            for c in output.outputs:
                if c.index in finished:
                    continue
                if c.index not in completion_tokens:  # OpenAI opens each choice with the role alone
                    completion_tokens[c.index] = 0
                    yield chunk(ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content="")))
                if not (c.text or c.token_ids or c.finish_reason):
                    continue
                completion_tokens[c.index] += len(c.token_ids)
                if c.finish_reason is not None:
                    finished.add(c.index)
                yield chunk(ChatStreamChoice(index=c.index, delta=DeltaMessage(content=c.text),
                                             logprobs=_logprobs(request, c), finish_reason=c.finish_reason,
                                             stop_reason=c.stop_reason))
    finally:
        await stream.aclose()
    if request.include_usage:
        yield ChatCompletionStreamResponse(id=request_id, model=ctx.model_name, choices=[],
                                           usage=usage_info(prompt_tokens, sum(completion_tokens.values())))
