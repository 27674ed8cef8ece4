"""The curl commands of USAGE ("Start the OpenAI-compatible server", "prompt_logprobs"), run verbatim but for
the address: the server under test listens on a free port of 127.0.0.1 and serves the name "model"."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

COMPLETION = """curl http://localhost:8000/v1/completions \\
  -H 'Content-Type: application/json' \\
  -d '{"model":"model","prompt":"The capital of France is","max_tokens":64}'"""

CHAT = """curl http://localhost:8000/v1/chat/completions \\
  -H 'Content-Type: application/json' \\
  -d '{"model":"model","messages":[{"role":"user","content":"hi"}],
       "chat_template_kwargs":{"enable_thinking":false}}'"""

PROMPT_LOGPROBS = """curl http://localhost:8000/v1/completions \\
  -H 'Content-Type: application/json' \\
  -d '{"model":"model","prompt":"The capital of France is",
       "max_tokens":1,"prompt_logprobs":5}'"""


def run_curl(command: str, url: str) -> dict:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    command = command.replace("http://localhost:8000", url)
    done = subprocess.run(["bash", "-c", command + " --silent --show-error --fail-with-body"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_completion(tiny_server):
    body = run_curl(COMPLETION, tiny_server.url)
    assert body["object"] == "text_completion" and body["model"] == "model"
    assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["text"]


def test_chat_with_template_kwargs(tiny_server):
    body = run_curl(CHAT, tiny_server.url)
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    # No max_tokens: the answer may run to max_model_len, never past it.
    assert body["usage"]["total_tokens"] <= 256


def test_prompt_logprobs(tiny_server):
    body = run_curl(PROMPT_LOGPROBS, tiny_server.url)
    tokens = run_curl_tokenize(tiny_server.url, "The capital of France is")
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(tokens) and entries[0] is None
    for token_id, position in zip(tokens[1:], entries[1:]):
        assert str(token_id) in position  # the token that actually follows is always scored
        assert {1, 2, 3, 4, 5} <= {e["rank"] for e in position.values()}
        assert all(set(e) == {"logprob", "rank", "decoded_token"} for e in position.values())
        assert 5 <= len(position) <= 6


def run_curl_tokenize(url: str, prompt: str) -> list[int]:
    command = (f"curl {url}/tokenize -H 'Content-Type: application/json' "
               f"-d '{json.dumps({'model': 'model', 'prompt': prompt})}'")
    return run_curl(command, url)["tokens"]
