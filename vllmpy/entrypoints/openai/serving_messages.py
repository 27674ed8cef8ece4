"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API translated onto the chat path.

system becomes a system message, tool_use blocks the assistant's tool_calls, tool_result blocks tool
messages, and a final assistant text is continued (Anthropic's prefill); tools (input_schema), tool_choice
(auto / any / tool / none) and thinking (enable_thinking) map onto the chat request as vLLM maps them. The chat answer's blocks become thinking, text and tool_use content
blocks; streamed, they arrive as Anthropic's events, message_start through message_stop.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from vllmpy.entrypoints.openai.anthropic_errors import anthropic_error
from vllmpy.entrypoints.openai.chat_bridge import (
    STREAM_USAGE,
    Block,
    BlockEvent,
    Closed,
    Ending,
    Finished,
    Grew,
    Opened,
    Started,
    chat_request,
    ending,
    message_blocks,
    run_chat,
    stream_blocks,
)
from vllmpy.entrypoints.openai.event_stream import Event, EventStream
from vllmpy.entrypoints.openai.protocol import ChatCompletionResponse, ErrorInfo
from vllmpy.entrypoints.openai.protocol_anthropic import (
    ContentBlock,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
    MessagesUsage,
    PromptFields,
    TextBlockParam,
    TextContent,
    ThinkingContent,
    ToolResultBlockParam,
    ToolUseBlockParam,
    ToolUseContent,
)
from vllmpy.entrypoints.openai.serving_chat import ChatParsers
from vllmpy.entrypoints.openai.serving_engine import ServingContext

# The chat request's field names → this API's, for refusals of the translated request.
RENAMES = {"stop": "stop_sequences", "response_format": "output_config"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
_DELTAS = {"text": ("text_delta", "text"), "reasoning": ("thinking_delta", "thinking"),
           "tool_call": ("input_json_delta", "partial_json")}


async def create_message(ctx: ServingContext, request: MessagesRequest,
                         parsers: ChatParsers) -> MessagesResponse | EventStream:
    fields = {**_prompt_fields(request), "max_tokens": request.max_tokens, "stop": request.stop_sequences,
              "temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k,
              "stream": request.stream, "stream_options": STREAM_USAGE if request.stream else None}
    result = await run_chat(ctx, parsers, chat_request(fields, RENAMES), RENAMES)
    message_id = f"msg_{uuid.uuid4().hex}"
    if isinstance(result, ChatCompletionResponse):
        end = ending(result)
        return MessagesResponse(id=message_id, model=ctx.model_name,
                                content=[_content(b) for b in message_blocks(result.choices[0].message)],
                                **_stop(end, request), usage=_usage(end))
    return EventStream(_events(message_id, ctx.model_name, request, stream_blocks(result)), _error_event)


def count_tokens(ctx: ServingContext, request: CountTokensRequest) -> CountTokensResponse:
    """The prompt's tokens as /v1/messages renders it (its usage.input_tokens for the same body)."""
    ctx.check_model(request.model)
    chat = chat_request(_prompt_fields(request), RENAMES)
    chat.check()
    return CountTokensResponse(input_tokens=len(ctx.encode(ctx.render_chat(chat), chat.add_special_tokens,
                                                           "messages")))


def _prompt_fields(request: PromptFields) -> dict[str, Any]:
    messages = chat_messages(request)
    fields: dict[str, Any] = {"model": request.model, "messages": messages}
    last = messages[-1] if messages else {}
    if last.get("role") == "assistant" and last.get("content") and "tool_calls" not in last:
        # Anthropic's prefill: the answer continues the final assistant text rather than starting a turn.
        fields.update(add_generation_prompt=False, continue_final_message=True)
    if request.tools is not None:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}} for t in request.tools]
    choice = request.tool_choice
    if choice is not None:
        fields["tool_choice"] = (_TOOL_CHOICES[choice.type] if choice.type != "tool"
                                 else {"type": "function", "function": {"name": choice.name}})
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    fields["chat_template_kwargs"] = _template_kwargs(request) or None
    output_format = request.output_config.format if request.output_config is not None else None
    if output_format is not None:
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "output", "schema": output_format.json_schema}}
    return fields


def _template_kwargs(request: PromptFields) -> dict[str, Any]:
    """thinking and output_config.effort as template variables (the reasoning parser reads the same ones),
    under the request's own chat_template_kwargs."""
    kwargs: dict[str, Any] = {}
    if request.thinking is not None:
        kwargs["enable_thinking"] = request.thinking.type != "disabled"
    if request.output_config is not None and request.output_config.effort is not None:
        kwargs["reasoning_effort"] = request.output_config.effort
    return {**kwargs, **(request.chat_template_kwargs or {})}


def chat_messages(request: PromptFields) -> list[dict[str, Any]]:
    """system, then each message; a message's tool_result blocks become tool messages ahead of its text
    (Anthropic puts results first in the user's turn), its tool_use blocks the assistant's tool_calls."""
    system = request.system
    messages = [] if system is None else [{"role": "system", "content": _text(system)}]
    for message in request.messages:
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts = [b.text for b in message.content if isinstance(b, TextBlockParam)]
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in message.content if isinstance(b, ToolUseBlockParam)]
        messages += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
                     for b in message.content if isinstance(b, ToolResultBlockParam)]
        if texts or calls:
            messages.append({"role": message.role, "content": "\n".join(texts) if texts else None,
                             **({"tool_calls": calls} if calls else {})})
    return messages


def _text(content: str | list[TextBlockParam]) -> str:
    return content if isinstance(content, str) else "\n".join(block.text for block in content)


def _content(block: Block) -> ContentBlock:
    if block.kind == "reasoning":
        return ThinkingContent(thinking=block.text)
    if block.kind == "tool_call":
        return ToolUseContent(id=block.call_id, name=block.name, input=json.loads(block.text or "{}"))
    return TextContent(text=block.text)


def _stop(end: Ending, request: MessagesRequest) -> dict[str, Any]:
    """stop_reason and stop_sequence: the stop string that ended the text, when one of stop_sequences did."""
    if end.finish_reason == "stop" and isinstance(end.stop_reason, str) and end.stop_reason in (
            request.stop_sequences or []):
        return {"stop_reason": "stop_sequence", "stop_sequence": end.stop_reason}
    return {"stop_reason": _STOP_REASONS.get(end.finish_reason, "end_turn"), "stop_sequence": None}


def _usage(end: Ending) -> MessagesUsage:
    return MessagesUsage(input_tokens=end.prompt_tokens, output_tokens=end.completion_tokens)


def _error_event(error: ErrorInfo) -> Event:
    return anthropic_error(error).model_dump()


async def _events(message_id: str, model: str, request: MessagesRequest,
                  blocks: AsyncIterator[BlockEvent]) -> AsyncIterator[Event]:
    index = -1
    async with aclosing(blocks) as events:
        async for event in events:
            if isinstance(event, Started):
                start = MessagesResponse(id=message_id, model=model, content=[],
                                         usage=MessagesUsage(input_tokens=event.prompt_tokens, output_tokens=0))
                yield {"type": "message_start", "message": start.model_dump(mode="json")}
            elif isinstance(event, Opened):
                index += 1
                opening = Block(event.block.kind, "", event.block.call_id, event.block.name)
                yield {"type": "content_block_start", "index": index,
                       "content_block": _content(opening).model_dump(mode="json")}
            elif isinstance(event, Grew):
                kind, key = _DELTAS[event.block.kind]
                yield {"type": "content_block_delta", "index": index, "delta": {"type": kind, key: event.delta}}
            elif isinstance(event, Closed):
                yield {"type": "content_block_stop", "index": index}
            elif isinstance(event, Finished):
                yield {"type": "message_delta", "delta": _stop(event.ending, request),
                       "usage": _usage(event.ending).model_dump()}
                yield {"type": "message_stop"}
