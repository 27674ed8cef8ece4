"""The default model (Gemma 3 270M GGUF, no chat template): 64 concurrent streaming clients, batched."""
from __future__ import annotations

import asyncio
import json

import pytest

from tests.server.conftest import ServerProcess, metric

httpx = pytest.importorskip("httpx")

KEY = "sk-default"
HEADERS = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The capital of France is", "Water boils at", "The largest planet is", "My favourite food is",
           "In 1969, astronauts", "The quick brown fox", "To make bread you need", "Python is a"]
CLIENTS = 64
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--api-key", KEY, "--max-num-seqs", str(CLIENTS), "--max-model-len", "2048")
    yield process
    process.stop()


def test_chat_without_template_names_the_flag(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", headers=HEADERS, timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "no chat template" in error["message"] and "--chat-template" in error["message"]


async def _stream(client: httpx.AsyncClient, prompt: str) -> tuple[str, list[str], dict]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    pieces, finish, usage = [], [], {}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                pieces.append(choice["text"])
                finish.append(choice["finish_reason"])
            usage = chunk.get("usage") or usage
    return "".join(pieces), finish, usage


async def _watch_running(client: httpx.AsyncClient, done: asyncio.Event) -> float:
    most = 0.0
    while not done.is_set():
        most = max(most, metric((await client.get("/metrics")).text, "vllm:num_requests_running"))
        await asyncio.sleep(0.02)
    return most


def test_64_concurrent_streams_complete_and_batch(server):
    reference = httpx.post(f"{server.url}/v1/completions", headers=HEADERS, timeout=120,
                           json={"prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0,
                                 "ignore_eos": True}).json()
    expected = {PROMPTS[c["index"]]: c["text"] for c in reference["choices"]}

    async def main():
        limits = httpx.Limits(max_connections=CLIENTS + 4)
        async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, timeout=300, limits=limits) as client:
            done = asyncio.Event()
            watcher = asyncio.create_task(_watch_running(client, done))
            results = await asyncio.gather(*[_stream(client, PROMPTS[i % len(PROMPTS)]) for i in range(CLIENTS)])
            done.set()
            return results, await watcher, (await client.get("/metrics")).text

    results, most_running, text = asyncio.run(main())
    for i, (generated, finish, usage) in enumerate(results):
        assert finish[-1] == "length" and usage["completion_tokens"] == MAX_TOKENS
        assert generated == expected[PROMPTS[i % len(PROMPTS)]]
    assert most_running >= CLIENTS // 4, f"the engine never ran more than {most_running} requests at once"
    assert metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:kv_cache_usage_perc") == 0
