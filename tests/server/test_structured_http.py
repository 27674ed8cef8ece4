"""Constrained decoding over HTTP with the official openai client, on the shared tiny random Llama: OpenAI's
response_format, vLLM's structured_outputs and its older guided_* fields, on both generation routes.

The model's text is random, so only the constraint can make it valid: each test checks the output against
it (the schema validates, the regex fullmatches, the choice is one of the set). Free JSON whitespace lets a
random model pad an object until max_tokens, so the JSON schemas sent without disable_any_whitespace are
top-level enums.
"""
from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

CITY = {"type": "string", "enum": ["Paris", "Rome"]}
CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
RECORD = {"type": "object", "additionalProperties": False, "required": ["city", "ok"],
          "properties": {"city": CITY, "ok": {"type": "boolean"}}}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["alpha", "beta", "gamma"]
MESSAGES = [{"role": "user", "content": "Where is the Eiffel tower?"}]
PROMPT = "The Eiffel tower is in"
COMMON = {"model": "model", "max_tokens": 64, "temperature": 0}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)


def _chat(client, **body) -> str:
    return client.chat.completions.create(messages=MESSAGES, **COMMON, **body).choices[0].message.content


def _complete(client, **body) -> str:
    # The openai client's completions.create has no response_format argument; vLLM's route takes it.
    if "response_format" in body:
        body["extra_body"] = {**body.get("extra_body", {}), "response_format": body.pop("response_format")}
    return client.completions.create(prompt=PROMPT, **COMMON, **body).choices[0].text


def _token_id(server, text: str) -> int:
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert len(tokens) == 1, tokens
    return tokens[0]


ROUTES = pytest.mark.parametrize("generate", [_chat, _complete], ids=["chat", "completions"])


@ROUTES
def test_response_format_json_schema(client, generate):
    jsonschema.validate(json.loads(generate(client, response_format=CITY_FORMAT)), CITY)


@ROUTES
def test_response_format_json_object_and_text(client, tiny_server, generate):
    # "{" and "}" favoured above all else: only the grammar keeps "}" from coming first, then it closes the object.
    bias = {str(_token_id(tiny_server, brace)): 100 for brace in "{}"}
    assert json.loads(generate(client, response_format={"type": "json_object"}, logit_bias=bias)) == {}
    assert generate(client, response_format={"type": "text"}) == generate(client)


@ROUTES
@pytest.mark.parametrize("body,satisfied", [
    ({"structured_outputs": {"regex": REGEX}}, lambda text: re.fullmatch(REGEX, text)),
    ({"guided_regex": REGEX}, lambda text: re.fullmatch(REGEX, text)),
    ({"structured_outputs": {"choice": CHOICES}}, lambda text: text in CHOICES),
    ({"guided_choice": CHOICES}, lambda text: text in CHOICES),
    ({"structured_outputs": {"json": RECORD, "disable_any_whitespace": True}},
     lambda text: jsonschema.validate(json.loads(text), RECORD) is None),
    ({"guided_json": CITY}, lambda text: jsonschema.validate(json.loads(text), CITY) is None),
], ids=["structured_outputs-regex", "guided_regex", "structured_outputs-choice", "guided_choice",
        "structured_outputs-json", "guided_json"])
def test_vllm_fields(client, generate, body, satisfied):
    text = generate(client, extra_body=body)
    assert satisfied(text), text


def test_streamed_chat_follows_the_schema(client):
    chunks = client.chat.completions.create(messages=MESSAGES, **COMMON, response_format=CITY_FORMAT, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    jsonschema.validate(json.loads(text), CITY)
    assert text == _chat(client, response_format=CITY_FORMAT)


REFUSALS = [
    # (route, extra body, param, words the message must hold)
    ("chat", {"response_format": CITY_FORMAT, "guided_regex": REGEX}, "guided_regex",
     ["response_format", "guided_regex"]),
    ("completions", {"structured_outputs": {"regex": REGEX}, "guided_choice": CHOICES}, "guided_choice",
     ["structured_outputs", "guided_choice"]),
    ("chat", {"guided_regex": REGEX, "tools": TOOLS, "tool_choice": "required"}, "guided_regex",
     ["tool_choice", "guided_regex"]),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     "response_format", ["strnig"]),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     ["schema"]),
    ("chat", {"response_format": {"type": "structural_tag"}}, "response_format", ["response_format"]),
    ("completions", {"guided_regex": "("}, "guided_regex", ["unclosed group"]),
    ("completions", {"guided_json": "{not json"}, "guided_json", ["not valid JSON"]),
    ("completions", {"guided_choice": []}, "guided_choice", ["choice"]),
    ("completions", {"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs", ["missing"]),
    ("completions", {"structured_outputs": {"regex": REGEX, "backend": "xgrammar"}}, "structured_outputs",
     ["backend"]),
    ("completions", {"structured_outputs": {"regex": REGEX, "choice": CHOICES}}, "structured_outputs",
     ["regex", "choice"]),
]


@pytest.mark.parametrize("route,body,param,words", REFUSALS, ids=[f"{r[0]}-{r[2]}-{i}" for i, r in enumerate(REFUSALS)])
def test_refused_by_name_then_serving(client, route, body, param, words):
    generate = _chat if route == "chat" else _complete
    with pytest.raises(openai.BadRequestError) as refused:
        generate(client, extra_body=body)
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"] == param, error
    assert all(word in error["message"] for word in words), error["message"]
    assert generate(client, extra_body={"guided_choice": CHOICES}) in CHOICES
