"""--api-key, --chat-template with --no-enable-thinking, and a SIGTERM that lands mid-stream."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from tests.server.conftest import ServerProcess
from vllmpy.entrypoints.openai.api_server import SHUTDOWN_GRACE_S

httpx = pytest.importorskip("httpx")

KEY = "sk-test-key"
# Renders what the template sees of enable_thinking, so /tokenize + /detokenize show the variable.
TEMPLATE = ("{% if enable_thinking is defined %}[thinking={{ enable_thinking }}]{% else %}[thinking unset]{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    process = ServerProcess("--model", tiny_llama_dir, "--chat-template", str(template), "--no-enable-thinking",
                            "--num-blocks", "64", "--max-model-len", "256", env={"VLLM_API_KEY": KEY})
    yield process
    process.stop(signal.SIGKILL)


def test_thinking_flags_leave_unset_or_set():
    from vllmpy.entrypoints.openai.api_server import build_parser, default_chat_template_kwargs

    parse = build_parser().parse_args
    assert default_chat_template_kwargs(parse([])) == {}
    assert default_chat_template_kwargs(parse(["--enable-thinking"])) == {"enable_thinking": True}
    assert default_chat_template_kwargs(parse(["--no-enable-thinking"])) == {"enable_thinking": False}


def test_api_key_guards_v1_only(server):
    url = server.url
    assert httpx.get(f"{url}/v1/models").status_code == 401
    wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "AuthenticationError"
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{url}{path}").status_code == 200


def test_cors_defaults_allow_any_origin_even_before_the_key(server):
    """vLLM's defaults (every origin, method and header; no credentials); a browser's preflight carries no
    Authorization, so it must be answered without the key."""
    preflight = httpx.options(f"{server.url}/v1/chat/completions", headers={
        "Origin": "http://anywhere.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in preflight.headers
    answer = httpx.get(f"{server.url}/v1/models", headers={"Origin": "http://anywhere.example",
                                                           "Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"


def test_openai_client_with_and_without_key(server):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    chat = good.chat.completions.create(model=good.models.list().data[0].id, max_tokens=3,
                                        messages=[{"role": "user", "content": "hi"}])
    assert chat.usage.completion_tokens == 3


def _rendered(server, **extra) -> str:
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    tokens = httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"]
    return httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_server_default_then_request_kwargs_win(server):
    assert _rendered(server) == "[thinking=False]<user>hi<assistant>"
    assert _rendered(server, chat_template_kwargs={"enable_thinking": True}).startswith("[thinking=True]")


def test_sigterm_mid_stream_exits_zero_without_traceback(server):
    body = {"prompt": "Tell me a long story", "max_tokens": 250, "ignore_eos": True, "n": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"  # finished or aborted, the stream is closed cleanly
    assert server.proc.wait(timeout=15) == 0
    assert time.monotonic() - start < SHUTDOWN_GRACE_S + 1
    assert "Traceback" not in server.stderr


def test_sigterm_under_load_exits_within_grace(smollm2_gguf_path):
    """Long prefills queued and streams generating when the grace ends (a SmolLM2 step over a 2048-token
    chunk takes about a second here): the process is still gone within the grace plus 1 s, exit 0, and
    every client got a closed answer (a stream ending [DONE], or a 503 if its request was still queued)."""
    server = ServerProcess("--model", smollm2_gguf_path, "--max-model-len", "4096")
    body = {"prompt": "Tell me a long story " * 600, "max_tokens": 500, "ignore_eos": True, "stream": True}
    answers: list[str] = []

    def client() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data:")]
            answers.append(lines[-1] if response.status_code == 200 else str(response.status_code))

    clients = [threading.Thread(target=client) for _ in range(4)]
    for thread in clients:
        thread.start()
    time.sleep(1.5)  # all four submitted, the engine inside their prefill
    start = time.monotonic()
    try:
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=15) == 0
        assert time.monotonic() - start < SHUTDOWN_GRACE_S + 1
    finally:
        for thread in clients:
            thread.join(timeout=15)
        stderr = server.stderr
        server.stop(signal.SIGKILL)
    assert sorted(set(answers)) <= ["503", "data: [DONE]"] and len(answers) == 4, answers
    assert "Traceback" not in stderr
