"""The bad-input corpus (issue 22): every malformed or over-large request is a 4xx in OpenAI's error shape
naming the field, answered before anything is queued; the next normal request is served; no 5xx, no hang,
and the server's memory stays bounded across the corpus.

Bodies are sent as ASCII JSON (json.dumps escapes lone surrogates as \\udXXX, as a hostile client would),
or as raw bytes where the bytes themselves are the bad input.
"""
from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")

NORMAL = {"model": "model", "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CMPL, CHAT_ROUTE = "/v1/completions", "/v1/chat/completions"
EMPTY_REGEX = "[^\\s\\S]"  # matches no string at all


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def user(content) -> dict:
    return {**CHAT, "messages": [{"role": "user", "content": content}]}


# (route, body: dict or raw bytes, param the error must name (None: the body as a whole), words the message has)
CORPUS = [
    # Invalid Unicode (lone surrogates), in every place text arrives.
    (CMPL, {**NORMAL, "prompt": "a\ud800b"}, "prompt", "surrogate"),
    (CMPL, {**NORMAL, "prompt": ["fine", "\udfff"]}, "prompt", "prompt[1]"),
    (CMPL, {**NORMAL, "stop": ["\ud834"]}, "stop", "surrogate"),
    (CMPL, b'{"model": "model", "prompt": "\xed\xa0\x80", "max_tokens": 2}', "prompt", "surrogate"),
    (CMPL, {**NORMAL, "structured_outputs": {"regex": "a\udc00"}}, "structured_outputs", "surrogate"),
    (CHAT_ROUTE, user("x\udfff"), "messages", "messages[0].content"),
    (CHAT_ROUTE, user([{"type": "text", "text": "\ud800"}]), "messages", "surrogate"),
    (CHAT_ROUTE, {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
     "tools", "surrogate"),
    (CHAT_ROUTE, {**CHAT, "chat_template_kwargs": {"\ud800": 1}}, "chat_template_kwargs", "surrogate"),
    ("/tokenize", {"model": "model", "prompt": "\ud800"}, "prompt", "surrogate"),
    ("/tokenize", {"model": "model", "messages": [{"role": "user", "content": "\udbff"}]}, "messages", "surrogate"),
    # Grammars whose language is empty or contradictory: refused at validation, naming the field sent.
    (CMPL, {**NORMAL, "structured_outputs": {"regex": EMPTY_REGEX}}, "structured_outputs", "matches no text"),
    (CMPL, {**NORMAL, "guided_regex": EMPTY_REGEX}, "guided_regex", "matches no text"),
    # A literal needing byte 0xF1 (U+411DA's lead byte), which SmolLM2's vocabulary has no token for.
    (CMPL, {**NORMAL, "guided_regex": "\u00a7\U000411dar"}, "guided_regex", "vocabulary cannot write"),
    (CMPL, {**NORMAL, "guided_json": {"type": "integer", "minimum": 5, "maximum": 2}}, "guided_json", "minimum"),
    (CMPL, {**NORMAL, "guided_json": {"enum": []}}, "guided_json", "unsatisfiable"),
    (CMPL, {**NORMAL, "guided_json": {"type": "string", "minLength": 5, "maxLength": 2}}, "guided_json", "minlength"),
    (CHAT_ROUTE, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "allOf": [{"type": "string"}, {"type": "integer"}]}}}}, "response_format", "unsatisfiable"),
    (CHAT_ROUTE, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": EMPTY_REGEX}}, "required": ["a"]}}}},
     "response_format", "unsatisfiable"),
    (CHAT_ROUTE, {**CHAT, "structured_outputs": {"regex": EMPTY_REGEX}}, "structured_outputs", "matches no text"),
    # Sampling fields out of range or of the wrong JSON type.
    (CMPL, {**NORMAL, "top_k": -2}, "top_k", "-1"),
    (CMPL, {**NORMAL, "top_k": -100}, "top_k", "-1"),
    (CMPL, {**NORMAL, "top_k": "5"}, "top_k", "integer"),
    (CMPL, {**NORMAL, "top_k": 1.5}, "top_k", "integer"),
    (CHAT_ROUTE, {**CHAT, "top_k": -2}, "top_k", "-1"),
    (CMPL, {**NORMAL, "stop_token_ids": [-1]}, "stop_token_ids", "0"),
    (CMPL, {**NORMAL, "stop_token_ids": [1, -5]}, "stop_token_ids", "0"),
    (CMPL, {**NORMAL, "stop_token_ids": ["5"]}, "stop_token_ids", "integer"),
    (CHAT_ROUTE, {**CHAT, "stop_token_ids": [-3]}, "stop_token_ids", "0"),
    (CMPL, {**NORMAL, "best_of": 0}, "best_of", "1"),
    (CMPL, {**NORMAL, "best_of": -1}, "best_of", "1"),
    (CMPL, {**NORMAL, "n": 2, "best_of": 1, "temperature": 1}, "best_of", "less than n"),
    (CMPL, {**NORMAL, "best_of": 3}, "best_of", "more than n"),
    (CMPL, {**NORMAL, "logprobs": True}, "logprobs", "integer"),
    (CMPL, {**NORMAL, "logprobs": "5"}, "logprobs", "integer"),
    (CMPL, {**NORMAL, "logprobs": 2.5}, "logprobs", "integer"),
    (CMPL, {**NORMAL, "logprobs": [1]}, "logprobs", "integer"),
    (CMPL, {**NORMAL, "logprobs": -2}, "logprobs", "-1"),
    (CHAT_ROUTE, {**CHAT, "logprobs": 5}, "logprobs", "boolean"),
    (CMPL, {**NORMAL, "min_p": 2}, "min_p", "1"),
    (CMPL, {**NORMAL, "repetition_penalty": 0}, "repetition_penalty", "0"),
    (CMPL, {**NORMAL, "frequency_penalty": -3}, "frequency_penalty", "-2"),
    (CMPL, {**NORMAL, "temperature": "0"}, "temperature", "number"),
    (CMPL, {**NORMAL, "max_tokens": 1.5}, "max_tokens", "integer"),
    (CMPL, {**NORMAL, "seed": "1"}, "seed", "integer"),
    (CMPL, {**NORMAL, "logit_bias": {"-1": 5}}, "logit_bias", "pattern"),
    (CMPL, {**NORMAL, "logit_bias": {"99999999": 5}}, "logit_bias", "range"),
    (CMPL, {**NORMAL, "prompt": [-1, 5]}, "prompt", "0"),
    (CMPL, {**NORMAL, "prompt": [[]]}, "prompt", "at least 1"),
    # Bounded work and response size per request: n and --max-logprobs (default 20), vocabulary size.
    (CMPL, {**NORMAL, "n": 65, "temperature": 1}, "n", "--max-num-seqs"),
    (CMPL, {**NORMAL, "n": 10000, "temperature": 1}, "n", "--max-num-seqs"),
    (CMPL, {**NORMAL, "n": 0}, "n", "1"),
    (CMPL, {**NORMAL, "n": True}, "n", "integer"),
    (CHAT_ROUTE, {**CHAT, "n": 65, "temperature": 1}, "n", "--max-num-seqs"),
    (CMPL, {**NORMAL, "logprobs": 21}, "logprobs", "--max-logprobs"),
    (CMPL, {**NORMAL, "logprobs": -1}, "logprobs", "--max-logprobs"),
    (CMPL, {**NORMAL, "logprobs": 100000}, "logprobs", "vocabulary size"),
    (CMPL, {**NORMAL, "echo": True, "logprobs": 50}, "logprobs", "--max-logprobs"),
    (CMPL, {**NORMAL, "prompt_logprobs": 21}, "prompt_logprobs", "--max-logprobs"),
    (CMPL, {**NORMAL, "prompt_logprobs": -1}, "prompt_logprobs", "--max-logprobs"),
    (CMPL, {**NORMAL, "prompt_logprobs": 1000000}, "prompt_logprobs", "vocabulary size"),
    (CHAT_ROUTE, {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs asks for 21"),
    (CHAT_ROUTE, {**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs", "0"),
    (CHAT_ROUTE, {**CHAT, "prompt_logprobs": 21}, "prompt_logprobs", "--max-logprobs"),
    (CMPL, {**NORMAL, "stream": True, "logprobs": 21}, "logprobs", "--max-logprobs"),  # a 400, not an SSE error
    (CHAT_ROUTE, {**CHAT, "stream": True, "n": 65, "temperature": 1}, "n", "--max-num-seqs"),
    # Chat messages.
    (CHAT_ROUTE, {**CHAT, "messages": []}, "messages", "at least 1"),
    (CHAT_ROUTE, {**CHAT, "messages": {"role": "user", "content": "hi"}}, "messages", "list"),
    (CHAT_ROUTE, {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages", "'assistant'"),
    (CHAT_ROUTE, {**CHAT, "messages": [{"content": "hi"}]}, "messages", "role"),
    (CHAT_ROUTE, {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "3"}]},
     "messages", "tool_call_id"),
    (CHAT_ROUTE, user([{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]), "messages",
     "'image_url' need a multimodal model"),
    (CHAT_ROUTE, user([{"type": "text", "text": "look"}, {"type": "input_audio", "input_audio": {}}]), "messages",
     "'input_audio' need a multimodal model"),
    (CHAT_ROUTE, user([{"type": "text"}]), "messages", "text"),
    ("/tokenize", {"model": "model", "messages": []}, "messages", "at least 1"),
    ("/detokenize", {"model": "model", "tokens": ["a"]}, "tokens", "integer"),
    # Deep nesting: refused with the limit named, whether the parser or the body check meets it first.
    (CMPL, {**NORMAL, "extra": nested(150)}, "extra", "100 levels"),
    (CMPL, {**NORMAL, "guided_json": deep_schema(80)}, "guided_json", "100 levels"),
    (CHAT_ROUTE, {**CHAT, "chat_template_kwargs": {"x": nested(120)}}, "chat_template_kwargs", "100 levels"),
    (CMPL, b'{"model": "model", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "too deeply"),
    # Bodies that are not a JSON object.
    (CMPL, b'{"model": "model", "prompt": "\xff\xfe"}', None, "utf-8"),
    (CMPL, b'{"model": "model", "prompt": ', None, "json"),
    (CMPL, b"[1, 2]", None, "object"),
    (CHAT_ROUTE, b'"hi"', None, "object"),
]


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=30) as client:
        yield client


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def rss_before(http, tiny_server) -> int:
    """The server's RSS once every path the corpus takes has run once (grammar compiler, logprobs, chat)."""
    warm = [(CMPL, NORMAL), (CMPL, {**NORMAL, "logprobs": 5, "prompt_logprobs": 5, "echo": True}),
            (CMPL, {**NORMAL, "guided_regex": "[ab]+"}), (CHAT_ROUTE, CHAT), ("/tokenize", {"prompt": "hi"})]
    for route, body in warm:
        assert http.post(route, json=body).status_code == 200
    for route, body, _, _ in CORPUS:
        _send(http, route, body)
    return _rss_kib(tiny_server.proc.pid)


def _send(http, route: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # ensure_ascii: \\ud800 escapes
    try:
        return http.post(route, content=content, headers={"Content-Type": "application/json"})
    except httpx.TimeoutException:
        pytest.fail(f"no answer within 30 s to {route} {content[:120]!r}")


def _normal_request_served(http) -> None:
    response = http.post(CMPL, json=NORMAL)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_corpus_size():
    assert len(CORPUS) >= 60


@pytest.mark.parametrize("route,body,param,words", CORPUS, ids=[f"{i}-{c[0]}-{c[2]}" for i, c in enumerate(CORPUS)])
def test_bad_input_refused_by_name(http, rss_before, route, body, param, words):
    response = _send(http, route, body)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["code"] == response.status_code and error["type"] == "BadRequestError", error
    assert error["param"] == param, error
    assert words.lower() in error["message"].lower(), error
    _normal_request_served(http)


@pytest.mark.parametrize("body", [{**NORMAL, "max_tokens": 2.0, "n": 1.0}, {**NORMAL, "prompt": [5, 6.0], "top_k": -1},
                                  {**NORMAL, "logprobs": 20, "prompt_logprobs": 20, "best_of": 1}])
def test_schema_valid_edges_served(http, body):
    """What the schema allows is served: JSON Schema integers include 2.0; the limits themselves pass."""
    response = _send(http, CMPL, body)
    assert response.status_code == 200, response.text


def test_rss_bounded_across_corpus(http, tiny_server, rss_before):
    """Two more passes over the corpus after the first: refused requests leave nothing behind."""
    for _ in range(2):
        for route, body, _, _ in CORPUS:
            assert _send(http, route, body).status_code < 500
    _normal_request_served(http)
    grown_mib = (_rss_kib(tiny_server.proc.pid) - rss_before) / 1024
    assert grown_mib < 64, f"server RSS grew {grown_mib:.0f} MiB over the corpus"
    assert http.get("/health").status_code == 200
