"""POST /v1/responses with the official openai client (responses.create / responses.stream / responses.retrieve)
on the tiny random Llama (SmolLM2's tokenizer) served as test_tools serves it: hermes template and tool parser,
qwen3 reasoning parser. Its text is random, so forced tool calls and schemas (enforced by the grammar) are what
must come back valid; plain text is checked whole against streamed, and the reasoning split against
reasoning.effort "none".
"""
from __future__ import annotations

import asyncio
import json
from http import HTTPStatus

import pytest

from tests.server.test_tools import tool_server  # noqa: F401 (the fixture: test_tools' server, one per module)
from vllmpy.entrypoints.openai.api_server import _event_sse
from vllmpy.entrypoints.openai.chat_bridge import Started
from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.entrypoints.openai.protocol_responses import ResponseObject
from vllmpy.entrypoints.openai.response_store import ResponseStore, StoredResponse
from vllmpy.entrypoints.openai.serving_responses import _ResponseEvents

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER},
         {"type": "function", "name": "get_time", "description": "Local time in a time zone",
          "parameters": {"type": "object", "additionalProperties": False, "required": ["tz"],
                         "properties": {"tz": {"type": "string", "maxLength": 8}}}}]
NAMED = {"type": "function", "name": "get_weather"}
NO_THINKING = {"effort": "none"}
TEXT = {"model": "model", "input": "Say hello.", "instructions": "Be brief.", "max_output_tokens": 8,
        "temperature": 0}


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0)


def _stream(client, **request):
    """The stream's event types, its events, and the client's final response."""
    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return [e.type for e in events], events, final


def test_text_whole_and_streamed(client):
    whole = client.responses.create(**TEXT, reasoning=NO_THINKING)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in whole.output] == ["message"] and whole.output_text
    assert whole.usage.output_tokens == 8 and whole.usage.total_tokens == whole.usage.input_tokens + 8

    types, events, final = _stream(client, **TEXT, reasoning=NO_THINKING)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[4:] == ["response.output_text.delta"] * len(deltas) + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert "".join(deltas) == final.output_text == whole.output_text  # temperature 0: the same tokens
    assert final.usage.input_tokens == whole.usage.input_tokens and final.status == "incomplete"


def test_reasoning_effort_maps_onto_the_reasoning_parser(client):
    plain = client.responses.create(**TEXT, reasoning=NO_THINKING)
    thinking = client.responses.create(**TEXT, reasoning={"effort": "high"})  # Qwen 3 thinks unless told not to
    assert [item.type for item in thinking.output] == ["reasoning"]
    assert thinking.output[0].content[0].text == plain.output_text.strip()
    types, events, final = _stream(client, **TEXT, reasoning={"effort": "high"})
    assert "response.reasoning_text.delta" in types and "response.output_text.delta" not in types
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        final.output[0].content[0].text == thinking.output[0].content[0].text


def test_forced_tool_call_round_trip(client):
    request = {"model": "model", "input": "What is the weather in Paris?", "tools": TOOLS, "max_output_tokens": 40,
               "temperature": 1.0, "extra_body": {"seed": 5}}
    called = client.responses.create(**request, tool_choice=NAMED)
    assert called.status == "completed" and [item.type for item in called.output] == ["function_call"]
    call = called.output[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    # The call and its output sent back as input items: rendered into the prompt, and the model called again.
    history = [{"role": "user", "content": "What is the weather in Paris?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}]
    again = client.responses.create(**{**request, "input": history},
                                    tool_choice={"type": "function", "name": "get_time"})
    assert again.output[0].name == "get_time" and again.usage.input_tokens > called.usage.input_tokens

    types, events, final = _stream(client, **request, tool_choice="required", parallel_tool_calls=False)
    assert "response.function_call_arguments.delta" in types and "response.output_text.delta" not in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == done.arguments == final.output[0].arguments
    schema = {tool["name"]: tool["parameters"] for tool in TOOLS}[final.output[0].name]
    jsonschema.validate(json.loads(streamed), schema)


def test_json_schema_text_format(client):
    city = {"type": "string", "enum": ["Paris", "Rome"]}  # top-level: no whitespace for random weights to pad
    got = client.responses.create(model="model", input="Which city?", max_output_tokens=20, temperature=1.0,
                                  text={"format": {"type": "json_schema", "name": "city", "schema": city,
                                                   "strict": True}}, extra_body={"seed": 1})
    assert got.status == "completed" and json.loads(got.output_text) in ("Paris", "Rome")
    assert got.text.format.type == "json_schema"


def test_store_retrieve_and_previous_response_id(client):
    first = client.responses.create(**TEXT, reasoning=NO_THINKING)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    follow = client.responses.create(**{**TEXT, "input": "And again?"}, reasoning=NO_THINKING,
                                     previous_response_id=first.id)
    alone = client.responses.create(**{**TEXT, "input": "And again?"}, reasoning=NO_THINKING)
    # The first turn (its input and output) precedes the new input; the instructions are sent again, not carried.
    assert follow.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert follow.previous_response_id == first.id

    unstored = client.responses.create(**TEXT, reasoning=NO_THINKING, store=False)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(unstored.id)
    assert missing.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(**TEXT, previous_response_id=unstored.id)
    assert unknown.value.body["param"] == "previous_response_id"


def test_a_failing_stream_ends_with_a_numbered_error_event():
    async def failing_blocks():
        yield Started(prompt_tokens=3)
        raise RequestError("the server is shutting down; the request was aborted", None,
                           HTTPStatus.SERVICE_UNAVAILABLE)

    async def frames() -> list[str]:
        started = ResponseObject(id="resp_x", status="in_progress", model="model")
        return [f async for f in _event_sse(_ResponseEvents(started, failing_blocks(), lambda *_: None).stream())]

    got = [json.loads(frame.split("data: ", 1)[1]) for frame in asyncio.run(frames())]
    assert [e["type"] for e in got] == ["response.created", "response.in_progress", "error"]
    assert got[-1]["sequence_number"] == 2 and got[-1]["code"] == "ServiceUnavailableError"


def test_store_is_bounded():
    store = ResponseStore(max_size=2)
    for i in range(3):
        store.put(StoredResponse(ResponseObject(id=f"resp_{i}", status="completed", model="m"), []))
    assert len(store) == 2 and store.get("resp_0") is None and store.get("resp_2") is not None


NORMAL = {"model": "model", "input": "hi", "max_output_tokens": 2}
REFUSALS = [
    ({"model": "model", "max_output_tokens": 2}, "input"),
    ({**NORMAL, "input": []}, "input"),
    ({**NORMAL, "input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({**NORMAL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input"),
    ({**NORMAL, "input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({**NORMAL, "input": [{"type": "function_call_output", "output": "no call_id"}]}, "input"),
    ({**NORMAL, "max_output_tokens": 0}, "max_output_tokens"),
    ({**NORMAL, "max_output_tokens": 5000}, "max_output_tokens"),  # past max_model_len: the chat path's check
    ({**NORMAL, "temperature": 2.5}, "temperature"),
    ({**NORMAL, "top_p": 0}, "top_p"),
    ({**NORMAL, "tools": [{"type": "web_search"}]}, "tools"),
    ({**NORMAL, "tools": [{"type": "function"}]}, "tools"),
    ({**NORMAL, "tool_choice": "required"}, "tool_choice"),
    ({**NORMAL, "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({**NORMAL, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({**NORMAL, "text": {"format": {"type": "yaml"}}}, "text"),
    ({**NORMAL, "reasoning": {"effort": "huge"}}, "reasoning"),
    ({**NORMAL, "background": True}, "background"),
    ({**NORMAL, "chat_template_kwargs": {"tools": 1}}, "chat_template_kwargs"),
    ({**NORMAL, "model": "not-served"}, "model"),
]


@pytest.mark.parametrize("body,param", REFUSALS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(REFUSALS)])
def test_refusals_name_the_field(tool_server, body, param):
    got = httpx.post(f"{tool_server.url}/v1/responses", json=body)
    assert got.status_code == (404 if param == "model" else 400), got.text
    assert got.json()["error"]["param"] == param, got.text
