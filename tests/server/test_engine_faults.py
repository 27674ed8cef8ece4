"""The engine loop cannot be killed by one request (issue 22): a client that disconnects while its request is
still queued is dropped, a request that fails inside a step fails alone with a 500 naming it, and a dead
engine makes the server answer 503 at once and exit non-zero. Faults come from the test-only hook
(vllmpy/engine/fault_injection.py)."""
from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

from tests.server.conftest import ServerProcess, metric
from vllmpy.engine.fault_injection import ENV_VAR

httpx = pytest.importorskip("httpx")

FAIL_MARKER = [7001, 7002, 7003]  # a prompt holding these ids raises while its output is processed
DIE_MARKER = [7004, 7005, 7006]  # ... and these kill the engine loop
BUSY_TOKENS = 1500  # one prefill of this many random tokens keeps the tiny model busy for ~0.2 s
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    """Prompts up to MAX_MODEL_LEN prefilled in one step, so that a long prompt holds the engine busy."""
    process = ServerProcess("--model", tiny_llama_dir, "--served-model-name", "model",
                            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", str(MAX_MODEL_LEN),
                            "--num-blocks", "512", env={ENV_VAR: json.dumps({"fail": FAIL_MARKER})})
    yield process
    process.stop()


def _busy_body(rng: random.Random) -> dict:
    """A fresh long prompt each time (a prefix-cache hit would make its prefill free)."""
    return {"model": "model", "prompt": [rng.randrange(3, 40000) for _ in range(BUSY_TOKENS)], "max_tokens": 2}


def _post_then_disconnect(url: str, body: dict, delay: float) -> None:
    """POST /v1/completions over a raw socket and close it `delay` seconds later, reading nothing."""
    address = urlsplit(url)
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection((address.hostname, address.port)) as sock:
        sock.sendall(head + payload)
        time.sleep(delay)


def _completion_tokens(response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["completion_tokens"]


def _wait_idle(client) -> str:
    for _ in range(100):
        text = client.get("/metrics").text
        if metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:num_requests_waiting") == 0:
            break
        time.sleep(0.05)
    return text


def test_disconnect_while_queued_never_kills_the_engine(server):
    """Each try: a long prefill runs, a short request arrives behind it and its client hangs up after a
    random delay (often while the request is still queued for the engine thread)."""
    rng = random.Random(22)
    with httpx.Client(base_url=server.url, timeout=30) as client, ThreadPoolExecutor(1) as pool:
        for _ in range(20):
            busy = pool.submit(client.post, "/v1/completions", json=_busy_body(rng))
            time.sleep(0.03)  # the busy request reaches the engine first
            _post_then_disconnect(server.url, {"model": "model", "prompt": [5, 6, 7], "max_tokens": 2},
                                  rng.uniform(0.0, 0.25))
            assert _completion_tokens(busy.result()) == 2
        fresh = client.post("/v1/completions", json={"model": "model", "prompt": [5, 6, 7], "max_tokens": 2})
        assert _completion_tokens(fresh) == 2
        assert client.get("/health").status_code == 200
        text = _wait_idle(client)
    assert metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:num_requests_waiting") == 0
    assert metric(text, "vllm:kv_cache_usage_perc") == 0  # every dropped request gave its blocks back


def test_request_failing_inside_the_step_fails_alone(server):
    """Three requests queue behind a long prefill, so they are added together and share their first step;
    the marked one raises there and gets a 500 naming it, the other two finish."""
    bodies = [{"model": "model", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
              for prompt in ([1, 2, 3, 4], [1, *FAIL_MARKER, 4], [1, 9, 3, 4])]
    with httpx.Client(base_url=server.url, timeout=30) as client, ThreadPoolExecutor(4) as pool:
        busy = pool.submit(client.post, "/v1/completions", json=_busy_body(random.Random(15)))
        time.sleep(0.03)
        good_1, failed, good_2 = pool.map(lambda body: client.post("/v1/completions", json=body), bodies)
        assert _completion_tokens(busy.result()) == 2
        assert client.get("/health").status_code == 200
    assert _completion_tokens(good_1) == 4 and _completion_tokens(good_2) == 4
    assert failed.status_code == 500
    message = failed.json()["error"]["message"]
    assert "request cmpl-" in message and "InjectedFault: injected fault (request cmpl-" in message


def test_dead_engine_answers_503_at_once_and_exits_nonzero(tiny_llama_dir):
    process = ServerProcess("--model", tiny_llama_dir, "--served-model-name", "model", "--num-blocks", "64",
                            "--max-model-len", "256", env={ENV_VAR: json.dumps({"die": DIE_MARKER})})
    try:
        with httpx.Client(base_url=process.url, timeout=10) as client, ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(client.post, "/v1/completions", json={
                "model": "model", "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True})
            time.sleep(0.1)
            killer = client.post("/v1/completions", json={"model": "model", "prompt": [1, *DIE_MARKER],
                                                          "max_tokens": 2})
            waiting = in_flight.result()
        for response in (killer, waiting):
            assert response.status_code == 503, response.text
            assert "InjectedEngineDeath: injected engine death" in response.json()["error"]["message"]
        returncode = process.proc.wait(timeout=10)
        stderr = process.stderr
    finally:
        process.stop()
    assert returncode == 1
    assert "vllm-server: error: the engine loop died: InjectedEngineDeath" in stderr


def test_dead_engine_health_and_new_requests_are_503(tiny_llama_dir, monkeypatch):
    """In-process (the subprocess above exits too soon to be asked): after the loop dies /health is 503
    and a new request of any route is a 503 naming the cause, without waiting for the engine."""
    from vllmpy.config import EngineConfig
    from vllmpy.engine.async_llm import AsyncLLM
    from vllmpy.entrypoints.openai.api_server import build_app
    from vllmpy.entrypoints.openai.serving_engine import ServingContext

    monkeypatch.setenv(ENV_VAR, json.dumps({"die": DIE_MARKER}))
    engine = AsyncLLM(EngineConfig.from_kwargs(model=tiny_llama_dir, num_blocks=64, max_model_len=256))
    app = build_app(ServingContext(engine, ["model"], tiny_llama_dir))

    async def main() -> list:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10) as client:
            healthy = (await client.get("/health")).status_code
            killer = await client.post("/v1/completions", json={"prompt": [1, *DIE_MARKER], "max_tokens": 2})
            return [healthy, killer, await client.get("/health"),
                    await client.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})]

    try:
        healthy, killer, health, chat, stream = asyncio.run(main())
    finally:
        engine.shutdown()
    assert healthy == 200 and killer.status_code == 503 and health.status_code == 503
    for response in (killer, chat, stream):
        assert response.status_code == 503, response.text
        assert "the engine loop died: InjectedEngineDeath" in response.json()["error"]["message"]
