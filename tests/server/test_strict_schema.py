"""Strict JSON schemas and forced tool calls on the real SmolLM2 135M instruct GGUF over HTTP.

A small real model asked for an object keeps inventing keys unless the grammar forbids them, so these
show what the grammar alone guarantees: `"strict": true` outputs hold no undeclared key at any depth,
forced calls (OpenAI's shape and LangChain's `bind_tools(tool_choice="any")`) end when the arguments
object closes with finish_reason "tool_calls", and instructor's `{"type": "json_object", "schema": ...}`
constrains the output. Each check's oracle is written out by hand, not derived by the code under test.
"""
from __future__ import annotations

import json
import re

import pytest

from tests.server.conftest import ServerProcess
from tests.server.test_tools import _reassemble

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

# What a client sends: pydantic-style, no additionalProperties anywhere, a $ref into $defs.
PERSON = {"type": "object", "required": ["name", "age", "address"], "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 16}}},
    "pets": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/Pet"}}},
    "$defs": {"Pet": {"type": "object", "required": ["kind"], "properties": {"kind": {"enum": ["cat", "dog"]}}}}}
# The same schema closed by hand: the oracle for "no undeclared keys".
CLOSED_PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "address"],
                 "properties": {
                     "name": {"type": "string", "maxLength": 16},
                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                     "address": {"type": "object", "additionalProperties": False, "required": ["city"],
                                 "properties": {"city": {"type": "string", "maxLength": 16}}},
                     "pets": {"type": "array", "maxItems": 2, "items": {
                         "type": "object", "additionalProperties": False, "required": ["kind"],
                         "properties": {"kind": {"enum": ["cat", "dog"]}}}}}}
PERSON_KEYS = {"name", "age", "address", "city", "pets", "kind"}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with name, age and address."}]

# LangChain's convert_to_openai_tool of two pydantic models (titles dropped, no additionalProperties).
LANGCHAIN_TOOLS = [
    {"type": "function", "function": {"name": "GetWeather", "description": "Get the current weather in a given city",
                                      "parameters": {"type": "object", "required": ["city"], "properties": {
                                          "city": {"description": "The city, e.g. Paris", "type": "string"}}}}},
    {"type": "function", "function": {"name": "GetPopulation", "description": "Get the population of a country",
                                      "parameters": {"type": "object", "required": ["country"], "properties": {
                                          "country": {"description": "The country, e.g. France", "type": "string"}}}}},
]
ARGUMENT_KEYS = {"GetWeather": {"city"}, "GetPopulation": {"country"}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol_server(smollm2_gguf_path):
    server = ServerProcess("--model", smollm2_gguf_path, "--served-model-name", "model", "--num-blocks", "192",
                           "--max-model-len", "1024", "--max-num-seqs", "32")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0)


def _person_format(strict: bool) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}


def test_strict_json_schema_samples_hold_no_undeclared_key(client):
    got = client.chat.completions.create(model="model", messages=ASK_PERSON, response_format=_person_format(True),
                                         n=20, temperature=1.0, seed=0, max_tokens=100)
    assert len(got.choices) == 20
    for choice in got.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), CLOSED_PERSON)


def test_without_strict_the_schema_stays_open(client):
    """The same request without strict: this model does write undeclared keys, so strict above is what stops it."""
    got = client.chat.completions.create(model="model", messages=ASK_PERSON, response_format=_person_format(False),
                                         n=8, temperature=1.0, seed=0, max_tokens=40)
    keys = {key for c in got.choices for key in re.findall(r'"(\w+)"\s*:', c.message.content)}
    assert keys - PERSON_KEYS, keys


def _check_calls(message, allowed: set[str]) -> None:
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        assert isinstance(arguments, dict) and set(arguments) <= ARGUMENT_KEYS[call.function.name], arguments


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "GetWeather"}}],
                         ids=["required", "named"])
def test_forced_call_stops_when_its_arguments_close(client, tool_choice):
    """One call (parallel_tool_calls false); with parallel calls allowed, how many to make is the model's choice."""
    request = {"model": "model", "messages": ASK_WEATHER, "tools": LANGCHAIN_TOOLS, "tool_choice": tool_choice,
               "parallel_tool_calls": False, "temperature": 1.0, "seed": 1, "max_tokens": 40}
    allowed = set(ARGUMENT_KEYS) if tool_choice == "required" else {"GetWeather"}
    got = client.chat.completions.create(**request, n=8)
    for choice in got.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        _check_calls(choice.message, allowed)

    content, reasoning, calls, finish = _reassemble(client.chat.completions.create(**request, stream=True))
    assert (content, reasoning, finish) == (None, None, "tool_calls") and calls
    for name, arguments in calls:
        assert name in allowed and set(json.loads(arguments)) <= ARGUMENT_KEYS[name], (name, arguments)


@pytest.mark.parametrize("parallel", [{}, {"parallel_tool_calls": False}], ids=["parallel-unset", "parallel-false"])
def test_langchain_bind_tools_any_request_shape(smol_server, parallel):
    """The body LangChain's ChatOpenAI sends for bind_tools(tools, tool_choice="any") (seed and max_tokens set
    as ChatOpenAI(seed=..., max_tokens=...) would), posted as it is."""
    body = {"messages": ASK_WEATHER, "model": "model", "stream": False, "n": 1, "temperature": 0.7, "seed": 3,
            "max_tokens": 64, "tools": LANGCHAIN_TOOLS, "tool_choice": "required", **parallel}
    got = httpx.post(f"{smol_server.url}/v1/chat/completions", json=body, timeout=60)
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert calls and (len(calls) == 1 or not parallel)
    for call in calls:
        assert call["type"] == "function" and call["id"]
        assert set(json.loads(call["function"]["arguments"])) <= ARGUMENT_KEYS[call["function"]["name"]]


# instructor's JSON_SCHEMA mode: a key the model would never write unprompted shows the schema was applied.
TICKET = {"type": "object", "additionalProperties": False, "required": ["ticket_id", "tier"],
          "properties": {"ticket_id": {"type": "integer", "minimum": 1, "maximum": 999},
                         "tier": {"enum": ["gold", "silver"]}}}


def test_instructor_json_object_schema_constrains_the_output(client):
    got = client.chat.completions.create(model="model", messages=ASK_PERSON, n=4, temperature=1.0, seed=2,
                                         max_tokens=40, response_format={"type": "json_object", "schema": TICKET})
    for choice in got.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), TICKET)


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "schema": TICKET,
                          "json_schema": {"name": "t", "schema": TICKET}}}, "response_format", ["json_object"]),
    ({"response_format": {"type": "text", "schema": TICKET}}, "response_format", ["json_object"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "sometimes"}}], "tool_choice": "required"},
     "tools", ["strict"]),
], ids=["schema-with-json_schema", "schema-with-text", "tool-strict-not-bool"])
def test_refused_by_name(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="model", messages=ASK_WEATHER, max_tokens=4, extra_body=body)
    error = refused.value.body
    assert error["param"] == param and all(w in error["message"] for w in words), error
