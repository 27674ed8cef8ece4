"""The non-generation routes, /metrics moving with the engine, token-id prompts, and client disconnects."""
from __future__ import annotations

import time

import pytest

from tests.server.conftest import metric

httpx = pytest.importorskip("httpx")

METRIC_NAMES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                "vllm:e2e_request_latency_seconds_count"]
LONG = {"model": "model", "prompt": "Tell me a long story", "max_tokens": 200, "ignore_eos": True, "n": 4}


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as client:
        yield client


def _metrics(http) -> str:
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return response.text


def _wait_idle(http, timeout: float = 10.0) -> str:
    """Metrics once nothing runs and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        text = _metrics(http)
        if metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:kv_cache_usage_perc") == 0:
            return text
        assert time.monotonic() < deadline, "requests still hold KV blocks:\n" + text
        time.sleep(0.05)


def test_health_version_openapi(http):
    from vllmpy import __version__

    assert http.get("/health").status_code == 200
    assert http.get("/version").json() == {"version": __version__}
    spec = http.get("/openapi.json").json()
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health",
                 "/version", "/metrics"):
        assert path in spec["paths"], path
    fields = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "echo", "logprobs", "prompt_logprobs", "priority", "stream_options"} <= set(fields)
    assert "400" in spec["paths"]["/v1/chat/completions"]["post"]["responses"]


def test_tokenize_detokenize_round_trip(http):
    tokens = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) and tokens["max_model_len"] == 256
    text = http.post("/detokenize", json={"model": "model", "tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hello"}]}).json()
    assert chat["count"] > tokens["count"]  # the template wraps the message


def test_token_id_prompts_match_text(http):
    ids = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    body = {"model": "model", "max_tokens": 6, "temperature": 0}
    from_text = http.post("/v1/completions", json={**body, "prompt": "Once upon a time"}).json()
    from_ids = http.post("/v1/completions", json={**body, "prompt": [ids, ids]}).json()
    assert [c["text"] for c in from_ids["choices"]] == [from_text["choices"][0]["text"]] * 2
    assert from_ids["usage"]["prompt_tokens"] == 2 * len(ids)


def test_metrics_follow_the_engine(http):
    before = _wait_idle(http)
    for name in METRIC_NAMES:
        metric(before, name)
    body = http.post("/v1/completions", json={"model": "model", "prompt": "Count: one two", "max_tokens": 5,
                                              "ignore_eos": True}).json()
    after = _wait_idle(http)
    usage = body["usage"]
    assert metric(after, "vllm:prompt_tokens_total") - metric(before, "vllm:prompt_tokens_total") == \
        usage["prompt_tokens"]
    assert metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total") == 5
    assert metric(after, "vllm:time_to_first_token_seconds_count") == \
        metric(before, "vllm:time_to_first_token_seconds_count") + 1
    assert metric(after, "vllm:inter_token_latency_seconds_count") == \
        metric(before, "vllm:inter_token_latency_seconds_count") + 4
    assert 'vllm:request_success_total{finished_reason="length"' in after


def test_stream_disconnect_aborts_and_frees_blocks(http):
    before = _wait_idle(http)
    with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data:")
            if seen == 3:
                break
        running = metric(_metrics(http), "vllm:num_requests_running")
    assert running == 4  # all four samples were still generating when the client left
    after = _wait_idle(http)
    generated = metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total")
    assert generated < 4 * 200
    assert 'vllm:request_success_total{finished_reason="abort"' in after


def test_non_stream_disconnect_aborts(http, tiny_server):
    before = _wait_idle(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{tiny_server.url}/v1/completions", json=LONG, timeout=0.3)
    after = _wait_idle(http)
    generated = metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total")
    assert generated < 4 * 200
