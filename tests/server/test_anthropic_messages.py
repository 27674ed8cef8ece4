"""POST /v1/messages and /v1/messages/count_tokens with the official anthropic SDK (base_url pointed at us,
its x-api-key checked against --api-key) on the tiny random Llama served like test_tools: hermes template and
tool parser, qwen3 reasoning parser. Forced tool calls and schemas are enforced by the grammar, so they must
come back valid; plain text is checked whole against streamed, thinking blocks against thinking disabled.
"""
from __future__ import annotations

import json

import pytest

from tests.server.conftest import ServerProcess
from tests.server.test_tools import HERMES_TEMPLATE

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

KEY = "test-key"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER},
         {"name": "get_time", "description": "Local time in a time zone", "input_schema": {
             "type": "object", "additionalProperties": False, "required": ["tz"],
             "properties": {"tz": {"type": "string", "maxLength": 8}}}}]
ASK = [{"role": "user", "content": "Say hello."}]
# The SDK has no sampling parameters any more; the API still takes them.
GREEDY = {"extra_body": {"temperature": 0}}
TEXT = {"model": "model", "max_tokens": 8, "messages": ASK, "system": [{"type": "text", "text": "Be brief."}],
        **GREEDY}
NO_THINKING = {"type": "disabled"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("messages") / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    server = ServerProcess("--model", tiny_llama_dir, "--served-model-name", "model", "--num-blocks", "128",
                           "--max-model-len", "1024", "--chat-template", str(template), "--enable-auto-tool-choice",
                           "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--api-key", KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def _stream(client, **request):
    """The stream's event types, its events, and the SDK's final message."""
    with client.messages.stream(**request) as stream:
        events = [e for e in stream if e.type in (
            "message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
            "message_stop")]  # the SDK adds derived events (text, thinking, input_json) of its own
        final = stream.get_final_message()
    return [e.type for e in events], events, final


def test_text_whole_and_streamed(client):
    whole = client.messages.create(**TEXT, thinking=NO_THINKING)
    assert [block.type for block in whole.content] == ["text"] and whole.content[0].text
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 8 and whole.id.startswith("msg_")

    types, events, final = _stream(client, **TEXT, thinking=NO_THINKING)
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert types == ["message_start", "content_block_start", *["content_block_delta"] * len(deltas),
                     "content_block_stop", "message_delta", "message_stop"]
    assert {e.delta.type for e in events if e.type == "content_block_delta"} == {"text_delta"}
    assert "".join(deltas) == final.content[0].text == whole.content[0].text  # temperature 0: the same tokens
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_thinking_blocks_from_the_reasoning_parser(client):
    plain = client.messages.create(**TEXT, thinking=NO_THINKING)
    thinking = client.messages.create(**TEXT)  # Qwen 3 thinks unless told not to
    assert [block.type for block in thinking.content] == ["thinking"]
    assert thinking.content[0].thinking == plain.content[0].text.strip()
    _, events, final = _stream(client, **TEXT, thinking={"type": "enabled", "budget_tokens": 1024})
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert {d.type for d in deltas} == {"thinking_delta"}
    assert "".join(d.thinking for d in deltas) == final.content[0].thinking == thinking.content[0].thinking


def test_tool_use_round_trip(client):
    request = {"model": "model", "max_tokens": 40, "tools": TOOLS, "extra_body": {"temperature": 1.0, "seed": 5}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.messages.create(**request, messages=ask, tool_choice={"type": "tool", "name": "get_weather"})
    assert called.stop_reason == "tool_use" and [block.type for block in called.content] == ["tool_use"]
    use = called.content[0]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER)

    # The call and its result sent back: rendered into the prompt, and the model calls again.
    history = [*ask, {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": "18 degrees, sunny"}]}]}]
    again = client.messages.create(**request, messages=history, tool_choice={"type": "tool", "name": "get_time"})
    assert again.content[0].name == "get_time" and again.usage.input_tokens > called.usage.input_tokens

    _, events, final = _stream(client, **request, messages=ask,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert events[1].content_block.type == "tool_use" and events[1].content_block.input == {}
    streamed = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert final.stop_reason == "tool_use" and json.loads(streamed) == final.content[0].input
    schema = {tool["name"]: tool["input_schema"] for tool in TOOLS}[final.content[0].name]
    jsonschema.validate(final.content[0].input, schema)


def test_stop_sequences(client):
    text = client.messages.create(**TEXT, thinking=NO_THINKING).content[0].text
    at = len(text) // 2
    stop = text[at:at + 3]
    at = text.index(stop)
    stopped = client.messages.create(**TEXT, thinking=NO_THINKING, stop_sequences=[stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[:at]
    _, _, final = _stream(client, **TEXT, thinking=NO_THINKING, stop_sequences=[stop])
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", stop, text[:at])


def test_count_tokens_matches_usage(client):
    request = {"model": "model", "messages": ASK, "system": "Be brief.", "tools": TOOLS}
    counted = client.messages.count_tokens(**request)
    served = client.messages.create(**request, max_tokens=1, thinking=NO_THINKING)
    assert counted.input_tokens == served.usage.input_tokens
    assert client.messages.count_tokens(model="model", messages=ASK).input_tokens < counted.input_tokens


def test_assistant_prefill_is_continued(client, server):
    prefilled = [*ASK, {"role": "assistant", "content": "Hello, my"}]
    counted = client.messages.count_tokens(model="model", messages=prefilled).input_tokens
    continued = httpx.post(f"{server.url}/tokenize", json={"messages": prefilled, "add_generation_prompt": False,
                                                           "continue_final_message": True}).json()["count"]
    new_turn = httpx.post(f"{server.url}/tokenize", json={"messages": prefilled}).json()["count"]
    assert counted == continued != new_turn
    served = client.messages.create(model="model", max_tokens=2, messages=prefilled, thinking=NO_THINKING)
    assert served.usage.input_tokens == counted and served.content[0].type == "text"


def test_output_config_json_schema(client):
    city = {"type": "string", "enum": ["Paris", "Rome"]}  # top-level: no whitespace for random weights to pad
    got = client.messages.create(model="model", max_tokens=20, messages=[{"role": "user", "content": "Which city?"}],
                                 output_config={"format": {"type": "json_schema", "schema": city}},
                                 extra_body={"temperature": 1.0, "seed": 1})
    assert got.stop_reason == "end_turn" and json.loads(got.content[0].text) in ("Paris", "Rome")


def test_api_key(server):
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(**TEXT)
    assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "authentication_error"
    # A bearer token is the key too, and x-api-key opens the OpenAI routes.
    body = {"model": "model", "max_tokens": 2, "messages": ASK}
    assert httpx.post(f"{server.url}/v1/messages", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": "wrong"}).status_code == 401


NORMAL = {"model": "model", "max_tokens": 2, "messages": ASK}
REFUSALS = [
    ("/v1/messages", {"model": "model", "messages": ASK}, "max_tokens"),
    ("/v1/messages", {**NORMAL, "max_tokens": 0}, "max_tokens"),
    ("/v1/messages", {**NORMAL, "max_tokens": 5000}, "max_tokens"),  # past max_model_len: the chat path's check
    ("/v1/messages", {**NORMAL, "messages": []}, "messages"),
    ("/v1/messages", {**NORMAL, "messages": [{"role": "system", "content": "hi"}]}, "messages"),
    ("/v1/messages", {**NORMAL, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, "messages"),
    ("/v1/messages", {**NORMAL, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages"),
    ("/v1/messages", {**NORMAL, "system": 5}, "system"),
    ("/v1/messages", {**NORMAL, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ("/v1/messages", {**NORMAL, "tools": [{"name": "f"}]}, "tools"),
    ("/v1/messages", {**NORMAL, "tool_choice": {"type": "any"}}, "tool_choice"),
    ("/v1/messages", {**NORMAL, "tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice"),
    ("/v1/messages", {**NORMAL, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ("/v1/messages", {**NORMAL, "temperature": 1.5}, "temperature"),
    ("/v1/messages", {**NORMAL, "top_k": -1}, "top_k"),
    ("/v1/messages", {**NORMAL, "stop_sequences": "STOP"}, "stop_sequences"),
    ("/v1/messages", {**NORMAL, "thinking": {"type": "sometimes"}}, "thinking"),
    ("/v1/messages", {**NORMAL, "output_config": {"format": {"type": "json_schema"}}}, "output_config"),
    ("/v1/messages/count_tokens", {"model": "model"}, "messages"),
    ("/v1/messages/count_tokens", {"model": "model", "messages": ASK, "tools": [{"name": "f"}]}, "tools"),
    ("/v1/messages", {**NORMAL, "model": "not-served"}, "model"),
]


@pytest.mark.parametrize("route,body,param", REFUSALS, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(REFUSALS)])
def test_refusals_in_anthropic_shape(server, route, body, param):
    got = httpx.post(f"{server.url}{route}", json=body, headers={"x-api-key": KEY})
    status, kind = (404, "not_found_error") if param == "model" else (400, "invalid_request_error")
    assert got.status_code == status, got.text
    assert got.json()["type"] == "error" and got.json()["error"]["type"] == kind, got.text
    assert got.json()["error"]["param"] == param and got.json()["error"]["message"], got.text


def test_sdk_raises_its_own_errors(client):
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="model", max_tokens=0, messages=ASK)
    assert "max_tokens" in refused.value.body["error"]["message"]
