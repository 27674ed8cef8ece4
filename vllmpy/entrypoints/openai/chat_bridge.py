"""What the Responses and Anthropic Messages routes share: both are translations onto the chat path.

A route builds a ChatCompletionRequest from its own body, runs it through create_chat_completion (templates,
tool and reasoning parsers, structured output, the engine) and reads the answer back as output blocks
(reasoning, text, tool calls in the order the model wrote them), whole or as a stream of block events.
Refusals of the chat path are renamed to the route's own field names, so a 400 still names what was sent.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
)
from vllmpy.entrypoints.openai.serving_chat import ChatParsers, create_chat_completion
from vllmpy.entrypoints.openai.serving_engine import ServingContext

BlockKind = Literal["reasoning", "text", "tool_call"]
# Every chunk carries usage, so the prompt's size is known from the first (the streamed headers need it).
STREAM_USAGE = {"include_usage": True, "continuous_usage_stats": True}


@dataclass
class Block:
    """One output block; `text` is the reasoning, the text, or a tool call's arguments (JSON text)."""

    kind: BlockKind
    text: str = ""
    call_id: str | None = None
    name: str | None = None


@dataclass
class Ending:
    """How the answer ended, in chat terms: finish_reason, stop_reason (the stop string or token) and usage."""

    finish_reason: str | None
    stop_reason: int | str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Started:
    prompt_tokens: int


@dataclass
class Opened:
    block: Block


@dataclass
class Grew:
    block: Block
    delta: str


@dataclass
class Closed:
    block: Block


@dataclass
class Finished:
    ending: Ending


BlockEvent = Started | Opened | Grew | Closed | Finished


def chat_request(fields: dict[str, Any], renames: Mapping[str, str]) -> ChatCompletionRequest:
    """The translated request; what the chat request refuses is reported under the route's field name."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else "body"
        where = ".".join(str(p) for p in error["loc"][1:])
        raise RequestError(f"{renames.get(field, field)}{'.' + where if where else ''}: {error['msg']}",
                           renames.get(field, field)) from None


async def run_chat(ctx: ServingContext, parsers: ChatParsers, request: ChatCompletionRequest,
                   renames: Mapping[str, str]) -> ChatCompletionResponse | AsyncIterator[ChatCompletionStreamResponse]:
    try:
        return await create_chat_completion(ctx, request, parsers)
    except RequestError as exc:
        raise _renamed(exc, renames) from None


def _renamed(exc: RequestError, renames: Mapping[str, str]) -> RequestError:
    """The refusal in the route's words: its param, and a message that opens with the chat field's name."""
    word, space, rest = exc.message.partition(" ")
    message = renames[word] + space + rest if word in renames else exc.message
    return RequestError(message, renames.get(exc.param, exc.param), exc.status)


def message_blocks(message: ChatResponseMessage) -> list[Block]:
    blocks = [Block("reasoning", message.reasoning_content)] if message.reasoning_content else []
    if message.content:
        blocks.append(Block("text", message.content))
    blocks += [Block("tool_call", c.function.arguments, c.id, c.function.name) for c in message.tool_calls]
    return blocks


def ending(response: ChatCompletionResponse) -> Ending:
    choice = response.choices[0]
    return Ending(choice.finish_reason, choice.stop_reason, response.usage.prompt_tokens,
                  response.usage.completion_tokens)


async def stream_blocks(chunks: AsyncIterator[ChatCompletionStreamResponse]) -> AsyncIterator[BlockEvent]:
    """The chat stream as block events: Started, then each block Opened, Grew..., Closed, then Finished.

    A block closes when text of another kind arrives; each tool call is its own block (the tool parsers
    finish one call before they start the next).
    """
    current: Block | None = None
    finish_reason = stop_reason = None
    usage = None
    async with aclosing(chunks):
        async for chunk in chunks:
            if chunk.usage is not None:
                if usage is None:
                    yield Started(chunk.usage.prompt_tokens)
                usage = chunk.usage
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            delta = choice.delta
            pieces = [Block("reasoning", delta.reasoning_content or ""), Block("text", delta.content or "")]
            pieces += [Block("tool_call", c.function.arguments or "", c.id, c.function.name)
                       for c in delta.tool_calls or []]
            for piece in pieces:
                if not piece.text and piece.call_id is None:
                    continue
                if piece.call_id is not None or current is None or current.kind != piece.kind:
                    if current is not None:
                        yield Closed(current)
                    current = Block(piece.kind, "", piece.call_id, piece.name)
                    yield Opened(current)
                if piece.text:
                    current.text += piece.text
                    yield Grew(current, piece.text)
            finish_reason = choice.finish_reason or finish_reason
            stop_reason = choice.stop_reason if choice.stop_reason is not None else stop_reason
    if current is not None:
        yield Closed(current)
    yield Finished(Ending(finish_reason, stop_reason, usage.prompt_tokens if usage else 0,
                          usage.completion_tokens if usage else 0))
