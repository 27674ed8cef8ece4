"""Every refusal of the issue: status, OpenAI error shape, the field named; the next normal request still works.
No bad input may produce a 5xx."""
from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")

BIG_PROMPT = "x" * 1_000_000  # far beyond 256 tokens x the longest vocabulary entry
NORMAL = {"model": "model", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

REFUSALS = [
    # (route, body, status, param)
    ("/v1/completions", {**NORMAL, "stream": True, "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ("/v1/completions", {**NORMAL, "prompt_logprobs": -2}, 400, "prompt_logprobs"),
    ("/v1/completions", {**NORMAL, "prompt_logprobs": "five"}, 400, "prompt_logprobs"),
    ("/v1/completions", {**NORMAL, "prompt_logprobs": [5]}, 400, "prompt_logprobs"),
    ("/v1/completions", {**NORMAL, "model": "not-served"}, 404, "model"),
    ("/v1/completions", {**NORMAL, "temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", {**NORMAL, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**NORMAL, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {**NORMAL, "n": 0}, 400, "n"),
    ("/v1/completions", {**NORMAL, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**NORMAL, "max_tokens": 300}, 400, "max_tokens"),
    ("/v1/completions", {**NORMAL, "prompt": list(range(300))}, 400, "prompt"),
    ("/v1/completions", {**NORMAL, "prompt": [[1, 2], [5, 10**9]]}, 400, "prompt"),
    ("/v1/completions", {**NORMAL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {**NORMAL, "prompt": BIG_PROMPT}, 400, "prompt"),
    ("/v1/completions", {**NORMAL, "suffix": "!"}, 400, "suffix"),
    ("/v1/completions", {**NORMAL, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**NORMAL, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {**NORMAL, "stop": 5}, 400, "stop"),
    ("/v1/completions", {**NORMAL, "n": 1.5}, 400, "n"),
    ("/v1/completions", {**NORMAL, "logit_bias": {"10000000": 5}}, 400, "logit_bias"),
    ("/v1/completions", {**NORMAL, "logit_bias": {"token": 5}}, 400, "logit_bias"),
    ("/v1/completions", {**NORMAL, "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {**NORMAL, "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {**NORMAL, "min_tokens": 9}, 400, "min_tokens"),
    ("/v1/completions", {**NORMAL, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "prompt_logprobs": 0}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": -5}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "model": "not-served"}, 404, "model"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 1000}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": BIG_PROMPT}]}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "add_generation_prompt": True, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, 400, "tool_choice"),
    *[("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {key: 1}}, 400, "chat_template_kwargs")
      for key in ("messages", "tools", "chat_template", "tokenize")],
    ("/tokenize", {"model": "model", "prompt": BIG_PROMPT}, 400, "prompt"),
    ("/tokenize", {"model": "not-served", "prompt": "hi"}, 404, "model"),
    ("/detokenize", {"model": "model", "tokens": [1, -4]}, 400, "tokens"),
]

# Odd but well-typed requests the engine must serve (or refuse) without a 5xx.
ODD_BUT_SERVED = [
    {**NORMAL, "top_k": 10**9, "temperature": 1.0, "seed": -(2**63)},
    {**NORMAL, "logprobs": 10**6, "max_tokens": 1},
    {**NORMAL, "prompt": "a b", "prompt_logprobs": -1, "max_tokens": 1},  # refused under --max-logprobs 20
    {**NORMAL, "stop_token_ids": [10**9], "min_tokens": 2},
    {**NORMAL, "logit_bias": {"0": 1e30}, "repetition_penalty": 1e30},
    {**NORMAL, "stop": [""], "priority": -10**12},
    {**NORMAL, "unknown_field": {"nested": True}},
]


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def normal_text(http):
    return _normal(http)


def _normal(http) -> str:
    response = http.post("/v1/completions", json=NORMAL)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.mark.parametrize("route,body,status,param", REFUSALS,
                         ids=[f"{r[0]}-{r[3]}-{i}" for i, r in enumerate(REFUSALS)])
def test_refused_by_name_then_serving(http, normal_text, route, body, status, param):
    response = http.post(route, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == status and error["message"] and error["type"]
    assert _normal(http) == normal_text


def test_malformed_json_refused(http, normal_text):
    for raw in (b'{"model": "model", "prompt": ', b"not json", b""):
        response = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "BadRequestError"
    assert _normal(http) == normal_text


def test_request_length_bound_message(http):
    response = http.post("/v1/completions", json={**NORMAL, "prompt": BIG_PROMPT})
    message = response.json()["error"]["message"]
    assert message.startswith("prompt length 1000000 bytes exceeds the maximum allowed prompt length of ")
    limit = int(message.rsplit(" of ", 1)[1].split()[0])
    assert limit % 256 == 0  # max_model_len x the longest vocabulary token


@pytest.mark.parametrize("body", ODD_BUT_SERVED, ids=range(len(ODD_BUT_SERVED)))
def test_odd_requests_never_500(http, normal_text, body):
    response = http.post("/v1/completions", json=body)
    assert response.status_code < 500, response.text
    assert _normal(http) == normal_text

