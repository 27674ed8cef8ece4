"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API translated onto the chat path.

The input items (after the stored conversation of previous_response_id, under the instructions as a system
message) become chat messages; tools, tool_choice, text.format and reasoning become the chat request's tools,
tool_choice, response_format and chat_template_kwargs. The chat answer's blocks become output items:
reasoning, message (output_text) and function_call. Streamed, they arrive as OpenAI's typed events, each
numbered by sequence_number, ending with response.completed (whose response says "incomplete" when
max_output_tokens ran out, as vLLM sends it, so that clients' get_final_response works either way).
"""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from http import HTTPStatus
from typing import Any

from vllmpy.entrypoints.openai.chat_bridge import (
    STREAM_USAGE,
    Block,
    BlockEvent,
    Closed,
    Ending,
    Finished,
    Grew,
    Opened,
    chat_request,
    ending,
    message_blocks,
    run_chat,
    stream_blocks,
)
from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.entrypoints.openai.event_stream import Event, EventStream
from vllmpy.entrypoints.openai.protocol import ChatCompletionResponse, ErrorInfo
from vllmpy.entrypoints.openai.protocol_responses import (
    FunctionCallInput,
    FunctionCallItem,
    FunctionCallOutputInput,
    FunctionChoice,
    IncompleteDetails,
    InputItem,
    InputMessage,
    InputText,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from vllmpy.entrypoints.openai.response_store import ResponseStore, StoredResponse
from vllmpy.entrypoints.openai.serving_chat import ChatParsers
from vllmpy.entrypoints.openai.serving_engine import ServingContext

# The chat request's field names → this API's, for refusals of the translated request.
RENAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
_ID_PREFIXES = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}
_DELTA_EVENTS = {"reasoning": "response.reasoning_text.delta", "text": "response.output_text.delta",
                 "tool_call": "response.function_call_arguments.delta"}
_DONE_EVENTS = {"reasoning": "response.reasoning_text.done", "text": "response.output_text.done",
                "tool_call": "response.function_call_arguments.done"}

Save = Callable[[ResponseObject, list[Block]], None]


async def create_response(ctx: ServingContext, request: ResponsesRequest, parsers: ChatParsers,
                          store: ResponseStore) -> ResponseObject | EventStream:
    request.check()
    history = _history(request, store)
    turn = chat_messages([InputMessage(role="user", content=request.input)] if isinstance(request.input, str)
                         else request.input)
    system = [{"role": "system", "content": request.instructions}] if request.instructions is not None else []
    chat = chat_request(_chat_fields(request, system + history + turn), RENAMES)
    result = await run_chat(ctx, parsers, chat, RENAMES)

    def save(response: ResponseObject, blocks: list[Block]) -> None:
        if request.store:
            store.put(StoredResponse(response, history + turn + [_assistant_message(blocks)]))

    started = _started(ctx, request)
    if isinstance(result, ChatCompletionResponse):
        blocks = message_blocks(result.choices[0].message)
        response = _finished(started, [_item(b, _new_id(b), "completed") for b in blocks], ending(result))
        save(response, blocks)
        return response
    return _ResponseEvents(started, stream_blocks(result), save).stream()


def retrieve_response(store: ResponseStore, response_id: str) -> ResponseObject:
    entry = store.get(response_id)
    if entry is None:
        raise RequestError(f"no stored response has id {response_id!r}", "response_id", HTTPStatus.NOT_FOUND)
    return entry.response


def chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages; function_call items join the assistant message before them (one turn's
    text and calls are one chat message), reasoning items are dropped."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallInput):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["tool_calls"] = [*messages[-1].get("tool_calls", []), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputInput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return messages


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def _history(request: ResponsesRequest, store: ResponseStore) -> list[dict[str, Any]]:
    if request.previous_response_id is None:
        return []
    entry = store.get(request.previous_response_id)
    if entry is None:
        raise RequestError(f"previous_response_id {request.previous_response_id!r} is not a stored response: it "
                           f"was created with store=false, does not exist, or was evicted (the server keeps the "
                           f"last {store.max_size})", "previous_response_id", HTTPStatus.NOT_FOUND)
    return entry.conversation


def _chat_fields(request: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "model": request.model, "messages": messages, "max_tokens": request.max_output_tokens,
        "temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k, "seed": request.seed,
        "parallel_tool_calls": request.parallel_tool_calls, "user": request.user, "stream": request.stream,
        "stream_options": STREAM_USAGE if request.stream else None,
        "chat_template_kwargs": _template_kwargs(request) or None,
    }
    if request.tools is not None:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in request.tools]
    choice = request.tool_choice
    fields["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                             if isinstance(choice, FunctionChoice) else choice)
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": text_format.model_dump(
            include={"name", "description", "json_schema", "strict"}, by_alias=True, exclude_none=True)}
    elif text_format is not None and text_format.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    return fields


def _template_kwargs(request: ResponsesRequest) -> dict[str, Any]:
    """reasoning.effort as template variables (the reasoning parser reads the same ones), under the
    request's own chat_template_kwargs."""
    kwargs: dict[str, Any] = {}
    effort = request.reasoning.effort if request.reasoning is not None else None
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        if effort == "none":
            kwargs["enable_thinking"] = False
    return {**kwargs, **(request.chat_template_kwargs or {})}


def _assistant_message(blocks: list[Block]) -> dict[str, Any]:
    text = "".join(b.text for b in blocks if b.kind == "text")
    calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
             for b in blocks if b.kind == "tool_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


def _started(ctx: ServingContext, request: ResponsesRequest) -> ResponseObject:
    """The response as it stands before any output: what response.created carries."""
    choice = request.tool_choice
    return ResponseObject(
        id=f"resp_{uuid.uuid4().hex}", status="in_progress", model=ctx.model_name,
        instructions=request.instructions,
        tools=[tool.model_dump(exclude_none=True) for tool in request.tools or []],
        tool_choice=choice.model_dump() if isinstance(choice, FunctionChoice) else choice or "auto",
        parallel_tool_calls=request.parallel_tool_calls, temperature=request.temperature, top_p=request.top_p,
        max_output_tokens=request.max_output_tokens, previous_response_id=request.previous_response_id,
        store=request.store, metadata=request.metadata or {}, user=request.user,
        text=request.text.model_dump(by_alias=True, exclude_none=True) if request.text and request.text.format
        else {"format": {"type": "text"}},
        reasoning=request.reasoning.model_dump() if request.reasoning is not None else None,
        truncation=request.truncation or "disabled")


def _finished(started: ResponseObject, output: list[OutputItem], end: Ending) -> ResponseObject:
    incomplete = end.finish_reason == "length"
    return started.model_copy(update={
        "status": "incomplete" if incomplete else "completed", "output": output,
        "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete else None,
        "usage": ResponseUsage(input_tokens=end.prompt_tokens, output_tokens=end.completion_tokens,
                               total_tokens=end.prompt_tokens + end.completion_tokens)})


def _new_id(block: Block) -> str:
    return f"{_ID_PREFIXES[block.kind]}_{uuid.uuid4().hex}"


def _item(block: Block, item_id: str, status: str) -> OutputItem:
    """The block as an output item; in progress, a message or reasoning item has no content part yet (the
    content_part.added event brings it)."""
    if block.kind == "tool_call":
        return FunctionCallItem(id=item_id, call_id=block.call_id, name=block.name, arguments=block.text,
                                status=status)
    done = status != "in_progress"
    if block.kind == "reasoning":
        return ReasoningItem(id=item_id, content=[ReasoningText(text=block.text)] if done else [], status=status)
    return OutputMessage(id=item_id, content=[OutputText(text=block.text)] if done else [], status=status)


def _part(block: Block) -> dict[str, Any]:
    part = ReasoningText(text=block.text) if block.kind == "reasoning" else OutputText(text=block.text)
    return part.model_dump()


class _ResponseEvents:
    """The block events of one streamed answer as Responses events, numbered from 0."""

    def __init__(self, started: ResponseObject, blocks: AsyncIterator[BlockEvent], save: Save) -> None:
        self._started = started
        self._blocks = blocks
        self._save = save
        self._sequence = 0

    def stream(self) -> EventStream:
        return EventStream(self._events(), self._error_event)

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _error_event(self, error: ErrorInfo) -> Event:
        return self._event("error", code=error.type, message=error.message, param=error.param)

    async def _events(self) -> AsyncIterator[Event]:
        snapshot = self._started.model_dump(mode="json")
        yield self._event("response.created", response=snapshot)
        yield self._event("response.in_progress", response=snapshot)
        items: list[OutputItem] = []
        blocks: list[Block] = []
        item_id = ""
        async with aclosing(self._blocks) as events:
            async for event in events:
                if isinstance(event, Opened):
                    item_id = _new_id(event.block)
                    for out in self._opened(event.block, item_id, len(items)):
                        yield out
                elif isinstance(event, Grew):
                    yield self._event(_DELTA_EVENTS[event.block.kind], delta=event.delta,
                                      **self._where(event.block, item_id, len(items)))
                elif isinstance(event, Closed):
                    items.append(_item(event.block, item_id, "completed"))
                    blocks.append(event.block)
                    for out in self._closed(event.block, items[-1], len(items) - 1):
                        yield out
                elif isinstance(event, Finished):
                    response = _finished(self._started, items, event.ending)
                    self._save(response, blocks)
                    yield self._event("response.completed", response=response.model_dump(mode="json"))

    def _opened(self, block: Block, item_id: str, index: int) -> list[Event]:
        item = _item(block, item_id, "in_progress").model_dump(mode="json")
        events = [self._event("response.output_item.added", output_index=index, item=item)]
        if block.kind != "tool_call":
            events.append(self._event("response.content_part.added", item_id=item_id, output_index=index,
                                      content_index=0, part=_part(Block(block.kind))))
        return events

    def _closed(self, block: Block, item: OutputItem, index: int) -> list[Event]:
        where = self._where(block, item.id, index)
        if block.kind == "tool_call":
            events = [self._event(_DONE_EVENTS["tool_call"], arguments=block.text, name=block.name, **where)]
        else:
            events = [self._event(_DONE_EVENTS[block.kind], text=block.text, **where),
                      self._event("response.content_part.done", item_id=item.id, output_index=index,
                                  content_index=0, part=_part(block))]
        return [*events, self._event("response.output_item.done", output_index=index,
                                     item=item.model_dump(mode="json"))]

    @staticmethod
    def _where(block: Block, item_id: str, index: int) -> dict[str, Any]:
        """The fields that place a delta or done event; text events carry (empty) logprobs, as OpenAI's do."""
        where: dict[str, Any] = {"item_id": item_id, "output_index": index}
        if block.kind != "tool_call":
            where["content_index"] = 0
        if block.kind == "text":
            where["logprobs"] = []
        return where
