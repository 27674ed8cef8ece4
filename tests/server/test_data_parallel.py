"""--data-parallel-size 2 behind one server (distributed/dp_client.py), on the tiny random Llama with one
thread per engine: the same greedy answers as one engine, a repeated prompt kept on the engine that holds
its prefix, per-engine and summed /metrics, and a killed engine failing only its own request."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess, metric
from vllmpy.entrypoints.openai import api_server

# The same flags as conftest's tiny_server (one engine), which is the reference.
FLAGS = ("--served-model-name", "model", "--num-blocks", "128", "--max-model-len", "256")
GREEDY = {"model": "model", "temperature": 0, "max_tokens": 12, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def dp_server(tiny_llama_dir):
    server = ServerProcess("--model", tiny_llama_dir, *FLAGS, "--data-parallel-size", "2")
    yield server
    server.stop()


def _text(url: str, route: str, body: dict) -> str:
    """The answer's text, whole or joined from its stream."""
    field = "text" if route == "completions" else "content"
    with httpx.stream("POST", f"{url}/v1/{route}", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        if not body.get("stream"):
            choice = json.loads(response.read())["choices"][0]
            return choice["text"] if route == "completions" else choice["message"]["content"]
        pieces = []
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                pieces.append(choice.get(field) or (choice.get("delta") or {}).get(field) or "")
        return "".join(pieces)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_and_chat_match_one_engine(dp_server, tiny_server, stream):
    for route, body in (("completions", {"prompt": "The capital of France is"}),
                        ("chat/completions", {"messages": MESSAGES})):
        request = {**GREEDY, **body, "stream": stream}
        expected = _text(tiny_server.url, route, request)
        assert expected and _text(dp_server.url, route, request) == expected, route


def _engine_metric(text: str, name: str, engine: int) -> float:
    match = re.search(rf'^{re.escape(name)}{{engine="{engine}",[^}}]*}} (\S+)$', text, re.MULTILINE)
    assert match, f"{name} for engine {engine} missing from /metrics"
    return float(match.group(1))


def _scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def test_a_repeated_prefix_stays_on_its_engine(dp_server):
    """Four sends of one 120-token prompt (7 full blocks) land on one engine: only its prefix-cache hits
    rise; the other engine admits none of its tokens. The summed series is the engines' sum."""
    names = ("vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total")
    before = _scrape(dp_server.url)
    prompt = list(range(1000, 1120))
    for _ in range(4):
        response = httpx.post(f"{dp_server.url}/v1/completions", timeout=60,
                              json={**GREEDY, "prompt": prompt, "max_tokens": 2})
        assert response.status_code == 200, response.text
    after = _scrape(dp_server.url)
    rise = {(name, e): _engine_metric(after, name, e) - _engine_metric(before, name, e)
            for name in names for e in (0, 1)}
    home = 0 if rise[("vllm:prompt_tokens_total", 0)] else 1
    assert rise[("vllm:prompt_tokens_total", home)] == 4 * len(prompt)
    assert rise[("vllm:prompt_tokens_total", 1 - home)] == 0
    assert rise[("vllm:prefix_cache_hits_total", home)] >= 3 * 7 * 16
    assert rise[("vllm:prefix_cache_hits_total", 1 - home)] == 0
    for name in names:
        assert metric(after, name) == sum(_engine_metric(after, name, e) for e in (0, 1))


def _engine_pids(url: str) -> dict[int, int]:
    found = re.findall(r'^vllmpy:data_parallel_engine_up\{engine="(\d)",pid="(\d+)"\} (\S+)$', _scrape(url),
                       re.MULTILINE)
    return {int(engine): int(pid) for engine, pid, up in found if float(up) == 1}


def _long_stream(url: str, prompt: str, started: threading.Event, result: dict) -> None:
    """A 240-token stream (about as long as max_model_len allows); `result` gets its finish reason, or the
    error event's message."""
    body = {**GREEDY, "prompt": prompt, "max_tokens": 240, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            started.set()
            if "error" in event:
                result["error"] = event["error"]["message"]
            elif event["choices"][0]["finish_reason"]:
                result["finish_reason"] = event["choices"][0]["finish_reason"]


def test_a_killed_engine_fails_only_its_request(dp_server):
    """Runs last: it leaves the server with one engine."""
    pids = _engine_pids(dp_server.url)
    assert sorted(pids) == [0, 1]
    runs = []
    for prompt in ("One long answer", "Another long answer"):  # one per engine: the second goes to the idle one
        started, result = threading.Event(), {}
        thread = threading.Thread(target=_long_stream, args=(dp_server.url, prompt, started, result))
        thread.start()
        assert started.wait(30)
        runs.append((thread, result))
    os.kill(pids[0], signal.SIGKILL)
    for thread, _ in runs:
        thread.join(60)
    outcomes = sorted(json.dumps(result) for _, result in runs)
    assert [result for _, result in runs if result.get("finish_reason") == "length"], outcomes
    failed = [result["error"] for _, result in runs if "error" in result]
    assert len(failed) == 1 and f"data parallel engine 0 (pid {pids[0]}) died" in failed[0], outcomes
    for _ in range(3):  # new requests route around the dead engine
        response = httpx.post(f"{dp_server.url}/v1/completions", json={**GREEDY, "prompt": "Still there?"}, timeout=60)
        assert response.status_code == 200, response.text
    assert httpx.get(f"{dp_server.url}/health", timeout=10).status_code == 200
    assert _engine_pids(dp_server.url) == {1: pids[1]}
    deadline = time.monotonic() + 10
    while "data parallel engine 0" not in dp_server.stderr and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"data parallel engine 0 (pid {pids[0]}) died" in dp_server.stderr


def test_data_parallel_size_0_is_refused_by_name(tiny_llama_dir, capsys):
    assert api_server.main(["--model", tiny_llama_dir, "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size must be >= 1" in capsys.readouterr().err


def test_offline_llm_refuses_data_parallel(tiny_llama_dir):
    from vllmpy import LLM

    with pytest.raises(ValueError, match="--data-parallel-size 2: data parallel runs behind vllm-server"):
        LLM(model=tiny_llama_dir, data_parallel_size=2)
