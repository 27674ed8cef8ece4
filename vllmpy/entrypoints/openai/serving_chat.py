"""POST /v1/chat/completions: messages rendered by the chat template, n choices, whole or streamed.

With --reasoning-parser and tool calling, each choice's text is split into reasoning_content, content and
tool_calls by ChatOutputParser; tool_choice "required" or a named function adds a JSON-schema grammar so
the model can only write a valid call; response_format, structured_outputs or guided_* constrain it instead
(one constraint per request).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs
from vllmpy.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from vllmpy.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStream
from vllmpy.entrypoints.openai.serving_engine import EngineStream, ServingContext, check_finished, random_id, usage_info
from vllmpy.entrypoints.openai.structured import Constraint, request_constraint
from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCallStream, ToolParser
from vllmpy.entrypoints.openai.tool_parsers.forced import (
    NamedToolParser,
    RequiredToolParser,
    named_schema,
    required_schema,
)
from vllmpy.outputs import CompletionOutput
from vllmpy.sampling_params import SamplingParams, StructuredOutputsParams


@dataclass(frozen=True)
class ChatParsers:
    """The server's parser flags: --tool-call-parser, --enable-auto-tool-choice, --reasoning-parser."""

    tool_parser: type[ToolParser] | None = None
    auto_tool_choice: bool = False
    reasoning_parser: type[ReasoningParser] | None = None

    @classmethod
    def from_flags(cls, tool_call_parser: str | None, enable_auto_tool_choice: bool,
                   reasoning_parser: str | None) -> ChatParsers:
        """ValueError names the flag and lists the valid parsers."""
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser; choose one of: "
                             + ", ".join(TOOL_PARSERS.names()))
        try:
            tools = TOOL_PARSERS.get(tool_call_parser) if tool_call_parser else None
        except ValueError as exc:
            raise ValueError(f"--tool-call-parser: {exc}") from None
        try:
            reasoning = REASONING_PARSERS.get(reasoning_parser) if reasoning_parser else None
        except ValueError as exc:
            raise ValueError(f"--reasoning-parser: {exc}") from None
        return cls(tools, enable_auto_tool_choice, reasoning)


NO_PARSERS = ChatParsers()


class ChatOutputParser:
    """One choice's text through the reasoning parser, then the tool parser on what is content.

    Streaming feeds each text delta; the whole response feeds the text once with final=True, so both
    read the same parse. Without parsers the text passes through as content.
    """

    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None,
                 max_calls: int | None = None) -> None:
        self._reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self._tools = ToolCallStream(tools, max_calls) if tools is not None else None

    @property
    def active(self) -> bool:
        return self._reasoning is not None or self._tools is not None

    def feed(self, text: str, final: bool = False) -> DeltaMessage:
        if not self.active:
            return DeltaMessage(content=text)
        reasoning, content = "", text
        if self._reasoning is not None:
            split = self._reasoning.feed(text, final)
            reasoning, content = split.reasoning, split.content
        calls = []
        if self._tools is not None:
            found = self._tools.feed(content, final)
            content = found.content
            calls = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                                   function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                     for c in found.tool_calls]
        return DeltaMessage(reasoning_content=reasoning or None, content=content or None, tool_calls=calls or None)

    def message(self, text: str) -> ChatResponseMessage:
        """The whole output as the response message."""
        if not self.active:
            return ChatResponseMessage(content=text)
        delta = self.feed(text, final=True)
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.function.name, arguments=c.function.arguments))
                 for c in delta.tool_calls or []]
        return ChatResponseMessage(content=delta.content, reasoning_content=delta.reasoning_content, tool_calls=calls)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model stopped after calling; length and aborts keep their reason."""
        called = self._tools is not None and self._tools.called
        return "tool_calls" if called and engine_reason == "stop" else engine_reason


@dataclass
class _OutputPlan:
    """How one request's choices are read, and what that asks of sampling."""

    tools: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    constraint: Constraint | None = None  # the request's own, or the grammar of a forced tool call
    max_calls: int | None = None

    def new_parser(self) -> ChatOutputParser:
        return ChatOutputParser(self.reasoning, self.tools, self.max_calls)

    def adjust(self, params: SamplingParams) -> SamplingParams:
        if any(parser is not None and parser.keeps_special_tokens for parser in (self.tools, self.reasoning)):
            return params.clone(skip_special_tokens=False)  # the format's markers must reach the parser
        return params


def _plan(request: ChatCompletionRequest, parsers: ChatParsers, template_kwargs: Mapping[str, Any]) -> _OutputPlan:
    plan = _OutputPlan(max_calls=None if request.parallel_tool_calls else 1)
    choice = request.resolved_tool_choice
    if choice == "auto":
        if not parsers.auto_tool_choice:
            raise RequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                               'set', "tool_choice")
        plan.tools = parsers.tool_parser(request.tools)  # the XML formats type values by the tools' schemas
    elif choice == "required":
        try:
            schema = required_schema(request.tools, request.parallel_tool_calls)
        except ValueError as exc:
            raise RequestError(str(exc), "tools") from None
        plan.tools, plan.constraint = RequiredToolParser(), _tool_grammar(schema)
    elif choice != "none":
        name = choice.function.name
        tool = next(t for t in request.tools if t["function"]["name"] == name)  # check() made sure it is there
        plan.tools, plan.constraint = NamedToolParser(name), _tool_grammar(named_schema(tool))
    requested = request_constraint(request)
    if requested is not None and plan.constraint is not None:
        raise RequestError(f"{requested.field} cannot constrain the output while tool_choice forces a tool call; "
                           "send one of them", requested.field)
    plan.constraint = plan.constraint or requested
    # A constrained output leaves no room to reason, so it is not split.
    if parsers.reasoning_parser is not None and plan.constraint is None:
        plan.reasoning = parsers.reasoning_parser({**template_kwargs, **(request.chat_template_kwargs or {})})
    return plan


def _tool_grammar(schema: dict[str, Any]) -> Constraint:
    """Compact JSON with no undeclared properties, strict or not: free whitespace and invented keys let small
    models pad a call until max_tokens, and the call must end when its arguments object closes (vLLM's
    default xgrammar backend writes no undeclared property either)."""
    return Constraint(StructuredOutputsParams(json=schema, disable_any_whitespace=True,
                                              disable_additional_properties=True), "tools")


async def create_chat_completion(ctx: ServingContext, request: ChatCompletionRequest, parsers: ChatParsers = NO_PARSERS
                                 ) -> ChatCompletionResponse | AsyncIterator[ChatCompletionStreamResponse]:
    request.check()
    ctx.check_model(request.model)
    plan = _plan(request, parsers, ctx.chat_template_kwargs)
    prompt = await ctx.chat_prompt(request)
    token_ids = prompt["prompt_token_ids"]
    max_tokens_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(request, max_tokens_field)
    # Engine messages name SamplingParams' fields; these are the chat request's names for them.
    renames = {"prompt": "messages", "max_tokens": max_tokens_field, "logprobs": "top_logprobs",
               "multi_modal_data": "messages"}
    if plan.constraint is not None:
        renames["structured_outputs"] = plan.constraint.field
    ctx.check_max_tokens(len(token_ids), max_tokens, max_tokens_field)
    params = plan.adjust(ctx.sampling_params(
        request, max_tokens=max_tokens, logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        prompt_logprobs=request.prompt_logprobs, renames=renames,
        structured_outputs=plan.constraint.params if plan.constraint is not None else None))
    request_id = random_id("chatcmpl")
    stream = await ctx.start(prompt, params, request, request_id,
                             delta=request.stream, renames=renames)
    if request.stream:
        return _stream(ctx, request, request_id, stream, plan)
    return await _collect(ctx, request, request_id, stream, plan)


def _logprobs(request: ChatCompletionRequest, completion: CompletionOutput) -> ChatLogprobs | None:
    if not request.logprobs:
        return None
    return chat_logprobs(completion.token_ids, completion.logprobs or [], request.top_logprobs or 0)


async def _collect(ctx: ServingContext, request: ChatCompletionRequest, request_id: str,
                   stream: EngineStream, plan: _OutputPlan) -> ChatCompletionResponse:
    final = None
    try:
        async for final in stream:
            pass
    finally:
        await stream.aclose()
    check_finished(final)
    choices = []
    for c in final.outputs:
        parser = plan.new_parser()
        choices.append(ChatChoice(index=c.index, message=parser.message(c.text), logprobs=_logprobs(request, c),
                                  finish_reason=parser.finish_reason(c.finish_reason), stop_reason=c.stop_reason))
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    return ChatCompletionResponse(
        id=request_id, model=ctx.response_model(request.model), choices=choices,
        usage=usage_info(len(final.prompt_token_ids), completion_tokens),
        # One rendered prompt serves every choice, so its logprobs sit beside the choices (as vLLM).
        prompt_logprobs=prompt_logprobs(final.prompt_logprobs) if request.prompt_logprobs is not None else None)


async def _stream(ctx: ServingContext, request: ChatCompletionRequest, request_id: str,
                  stream: EngineStream, plan: _OutputPlan) -> AsyncIterator[ChatCompletionStreamResponse]:
    prompt_tokens = 0
    completion_tokens: dict[int, int] = {}
    parsers: dict[int, ChatOutputParser] = {}
    finished: set[int] = set()

    def chunk(choice: ChatStreamChoice) -> ChatCompletionStreamResponse:
        usage = usage_info(prompt_tokens, sum(completion_tokens.values())) if request.continuous_usage else None
        return ChatCompletionStreamResponse(id=request_id, model=ctx.response_model(request.model), choices=[choice],
                                            usage=usage)

    try:
        async for output in stream:
            check_finished(output)
            prompt_tokens = len(output.prompt_token_ids)
            for c in output.outputs:
                if c.index in finished:
                    continue
                if c.index not in completion_tokens:  # OpenAI opens each choice with the role alone
                    completion_tokens[c.index] = 0
                    parsers[c.index] = plan.new_parser()
                    yield chunk(ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content="")))
                if not (c.text or c.token_ids or c.finish_reason):
                    continue
                completion_tokens[c.index] += len(c.token_ids)
                parser = parsers[c.index]
                delta = parser.feed(c.text, final=c.finish_reason is not None)
                if c.finish_reason is not None:
                    finished.add(c.index)
                elif parser.active and not (delta.content or delta.reasoning_content or delta.tool_calls
                                            or request.logprobs):
                    continue  # the parser holds this text until it knows what it is
                yield chunk(ChatStreamChoice(index=c.index, delta=delta, logprobs=_logprobs(request, c),
                                             finish_reason=parser.finish_reason(c.finish_reason),
                                             stop_reason=c.stop_reason))
    finally:
        await stream.aclose()
    if request.include_usage:
        yield ChatCompletionStreamResponse(id=request_id, model=ctx.response_model(request.model), choices=[],
                                           usage=usage_info(prompt_tokens, sum(completion_tokens.values())))
