"""POST /v1/completions: one or more prompts (text or token ids) times n choices, whole or streamed.

Choice i*n + j is the j-th sample of prompt i, as in vLLM.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, aclosing

from vllmpy.entrypoints.openai.logprobs import completion_logprobs, prompt_logprobs
from vllmpy.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
)
from vllmpy.entrypoints.openai.serving_engine import EngineStream, ServingContext, check_finished, random_id, usage_info
from vllmpy.entrypoints.openai.structured import request_constraint
from vllmpy.outputs import CompletionOutput, RequestOutput
from vllmpy.sampling_params import SamplingParams


async def create_completion(ctx: ServingContext, request: CompletionRequest
                            ) -> CompletionResponse | AsyncIterator[CompletionStreamResponse]:
    request.check()
    ctx.check_model(request.model)
    prompts = _engine_prompts(ctx, request)
    for prompt in prompts:
        ctx.check_max_tokens(len(prompt["prompt_token_ids"]), request.max_tokens, "max_tokens")
    # echo with logprobs scores the echoed prompt too, so the engine computes prompt logprobs for it.
    engine_prompt_logprobs = request.prompt_logprobs
    if engine_prompt_logprobs is None and request.echo and request.logprobs is not None:
        engine_prompt_logprobs = request.logprobs
    constraint = request_constraint(request)
    # The completions fields carry SamplingParams' own names, but for the constraint's source.
    renames = {"structured_outputs": constraint.field} if constraint is not None else {}
    params = ctx.sampling_params(request, max_tokens=request.max_tokens, logprobs=request.logprobs,
                                 prompt_logprobs=engine_prompt_logprobs, renames=renames,
                                 structured_outputs=constraint.params if constraint is not None else None)
    request_id = random_id("cmpl")
    streams = await _start_all(ctx, request, params, prompts, request_id, renames)
    builder = _ChoiceBuilder(ctx, request)
    if request.stream:
        return _stream(ctx, request, request_id, streams, builder)
    return await _collect(ctx, request, request_id, streams, builder)


async def _start_all(ctx: ServingContext, request: CompletionRequest, params: SamplingParams, prompts: list[dict],
                     request_id: str, renames: dict[str, str]) -> list[EngineStream]:
    """Submit every prompt at once (they share prefill steps; one at a time cost a step each). The first
    failure in prompt order answers the request and every stream that did start is closed (aborted),
    also when the client goes away while they start."""
    tasks = [asyncio.ensure_future(ctx.start(prompt, params, request, f"{request_id}-{i}", delta=request.stream,
                                             renames=renames)) for i, prompt in enumerate(prompts)]
    try:
        await asyncio.wait(tasks)
    except BaseException:
        await _close_started(tasks)
        raise
    failure = next((task.exception() for task in tasks if task.exception() is not None), None)
    if failure is not None:
        await _close_started(tasks)
        raise failure
    return [task.result() for task in tasks]


async def _close_started(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()  # a no-op on a finished one
    await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if not task.cancelled() and task.exception() is None:
            await task.result().aclose()


def _engine_prompts(ctx: ServingContext, request: CompletionRequest) -> list[dict]:
    prompt = request.prompt  # never an empty list (the schema's minItems)
    items = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    return [{"prompt": item, "prompt_token_ids": ctx.encode(item, request.add_special_tokens, "prompt")}
            if isinstance(item, str) else {"prompt_token_ids": list(item)} for item in items]


class _ChoiceBuilder:
    """Text and logprobs of one choice (or one streamed piece of it), with the prompt prepended under echo."""

    def __init__(self, ctx: ServingContext, request: CompletionRequest) -> None:
        self._decode_cache: dict[int, str] = {}
        self._tokenizer = ctx.tokenizer
        self._request = request

    def decode(self, token_id: int) -> str:
        text = self._decode_cache.get(token_id)
        if text is None:
            text = self._decode_cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def piece(self, output: RequestOutput, completion: CompletionOutput, with_prompt: bool,
              text_offset: int) -> tuple[str, CompletionLogprobs | None]:
        text, token_ids, positions = completion.text, completion.token_ids, completion.logprobs or []
        if with_prompt and self._request.echo:
            prompt_text = output.prompt
            if prompt_text is None:
                prompt_text = self._tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)
            text = prompt_text + text
            token_ids = output.prompt_token_ids + token_ids
            positions = list(output.prompt_logprobs or [None] * len(output.prompt_token_ids)) + positions
        if self._request.logprobs is None:
            return text, None
        return text, completion_logprobs(token_ids, positions, self.decode, text_offset)


async def _collect(ctx: ServingContext, request: CompletionRequest, request_id: str, streams: list[EngineStream],
                   builder: _ChoiceBuilder) -> CompletionResponse:
    finals: list[RequestOutput] = []
    async with AsyncExitStack() as stack:
        for stream in streams:
            stack.push_async_callback(stream.aclose)
        for stream in streams:
            final = None
            async for final in stream:
                pass
            check_finished(final)
            finals.append(final)
    choices = []
    for i, final in enumerate(finals):
        for completion in final.outputs:
            text, logprobs = builder.piece(final, completion, with_prompt=True, text_offset=0)
            choices.append(CompletionChoice(
                index=i * request.n + completion.index, text=text, logprobs=logprobs,
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                prompt_logprobs=prompt_logprobs(final.prompt_logprobs) if request.prompt_logprobs is not None
                else None))
    prompt_tokens = sum(len(f.prompt_token_ids) for f in finals)
    completion_tokens = sum(len(c.token_ids) for f in finals for c in f.outputs)
    return CompletionResponse(id=request_id, model=ctx.response_model(request.model), choices=choices,
                              usage=usage_info(prompt_tokens, completion_tokens))


async def _stream(ctx: ServingContext, request: CompletionRequest, request_id: str, streams: list[EngineStream],
                  builder: _ChoiceBuilder) -> AsyncIterator[CompletionStreamResponse]:
    prompt_tokens = [0] * len(streams)
    completion_tokens: dict[int, int] = {}
    text_offsets: dict[int, int] = {}
    finished: set[int] = set()
    async with AsyncExitStack() as stack:
        for stream in streams:
            stack.push_async_callback(stream.aclose)
        merged = await stack.enter_async_context(aclosing(_merge(streams)))  # closed before the streams
        async for i, output in merged:
            check_finished(output)
            prompt_tokens[i] = len(output.prompt_token_ids)
            for completion in output.outputs:
                index = i * request.n + completion.index
                first = index not in text_offsets
                if index in finished or not (first or completion.token_ids or completion.finish_reason):
                    continue
                completion_tokens[index] = completion_tokens.get(index, 0) + len(completion.token_ids)
                text, logprobs = builder.piece(output, completion, with_prompt=first,
                                               text_offset=text_offsets.get(index, 0))
                text_offsets[index] = text_offsets.get(index, 0) + len(text)
                if completion.finish_reason is not None:
                    finished.add(index)
                usage = usage_info(sum(prompt_tokens), sum(completion_tokens.values())) \
                    if request.continuous_usage else None
                yield CompletionStreamResponse(
                    id=request_id, model=ctx.response_model(request.model), usage=usage,
                    choices=[CompletionStreamChoice(index=index, text=text, logprobs=logprobs,
                                                    finish_reason=completion.finish_reason,
                                                    stop_reason=completion.stop_reason)])
    if request.include_usage:
        yield CompletionStreamResponse(id=request_id, model=ctx.response_model(request.model), choices=[],
                                       usage=usage_info(sum(prompt_tokens), sum(completion_tokens.values())))


async def _merge(streams: list[EngineStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several prompts' outputs in arrival order, tagged with the prompt's position."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: EngineStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
            queue.put_nowait((i, None))
        except Exception as exc:  # re-raised below, in the consumer
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
