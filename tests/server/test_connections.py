"""Connection bounds and CORS on a real server: idle and half-sent requests are closed within their
timeouts, connections past --limit-connections are closed at once, requests past --limit-concurrency get
a 503 (and the server serves again once they are gone), and CORS answers as the flags say."""
from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import pytest

from tests.server.conftest import ServerProcess

httpx = pytest.importorskip("httpx")

KEEP_ALIVE_S = 2.0
READ_S = 3.0
MAX_CONNECTIONS = 6
GOOD = "http://good.example"
# How long a socket waits for the server's answer: generous, but well below anything that never ends.
WAIT_S = 10.0


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    process = ServerProcess("--model", tiny_llama_dir, "--num-blocks", "64", "--max-model-len", "128",
                            "--timeout-keep-alive", str(KEEP_ALIVE_S), "--timeout-request-read", str(READ_S),
                            "--limit-concurrency", "2", "--limit-connections", str(MAX_CONNECTIONS),
                            "--allowed-origins", json.dumps([GOOD]), "--allowed-methods", '["GET", "POST"]',
                            "--allow-credentials")
    yield process
    process.stop()


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=WAIT_S)


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sent before closing, which it must do within `seconds` (else recv times out)."""
    start = time.monotonic()
    data = _read_until_closed(sock)
    elapsed = time.monotonic() - start
    assert elapsed < seconds, f"connection still open after {elapsed:.1f} s"
    return data


def test_silent_connection_is_closed_after_keep_alive_timeout(server):
    with _connect(server.url) as sock:
        data = _closed_within(sock, KEEP_ALIVE_S + WAIT_S / 2)
    assert data == b""


def test_kept_alive_connection_is_closed_when_idle(server):
    with _connect(server.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        data = _closed_within(sock, KEEP_ALIVE_S + WAIT_S / 2)
    assert data.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("sent", [b"GET /health HT", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                                  b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"pro"],
                         ids=["request-line", "body"])
def test_half_sent_request_is_answered_408(server, sent):
    with _connect(server.url) as sock:
        sock.sendall(sent)
        data = _closed_within(sock, READ_S + WAIT_S / 2)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert "--timeout-request-read" in json.loads(body)["error"]["message"]


def test_trickled_headers_do_not_reset_the_read_deadline(server):
    """Slowloris: a byte every 0.2 s keeps the socket busy but must not keep it open."""
    request = b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 200
    with _connect(server.url) as sock:
        sock.settimeout(0.2)
        start = time.monotonic()
        data = b""
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
                data = sock.recv(65536)
            except socket.timeout:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if data or time.monotonic() - start > READ_S + WAIT_S:
                break
    assert data.startswith(b"HTTP/1.1 408"), data


def test_connections_past_the_cap_are_closed_at_once(server):
    held = [_connect(server.url) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in held:  # each one is accepted and answered: all the slots are taken
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        refused = [_connect(server.url) for _ in range(20)]
        for sock in refused:
            try:
                sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert _read_until_closed(sock) == b""
            sock.close()
    finally:
        for sock in held:
            sock.close()
    assert _healthy_soon(server)


def _healthy_soon(server) -> bool:
    """The slots free up once the closed sockets are reaped (a moment after their close)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{server.url}/health", timeout=WAIT_S).status_code == 200:
                return True
        except httpx.TransportError:
            time.sleep(0.1)
    return False


def _half_sent_post(server) -> socket.socket:
    """A request in flight for READ_S: its headers are in (so the app runs), its body never completes."""
    sock = _connect(server.url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: 100\r\n\r\n{")
    return sock


def _complete_until(server, done: Callable[[int], bool], within: float) -> httpx.Response:
    """Send a small completion (from a browser page at GOOD) until its status satisfies `done`, or `within`
    seconds pass."""
    deadline = time.monotonic() + within
    while True:
        answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                            headers={"Origin": GOOD}, timeout=WAIT_S)
        if done(answer.status_code) or time.monotonic() > deadline:
            return answer
        time.sleep(0.05)


def test_requests_past_the_concurrency_limit_get_503_then_are_served(server):
    held = [_half_sent_post(server) for _ in range(2)]
    try:  # the held two are in flight once the server has read their headers
        refused = _complete_until(server, lambda status: status == 503, within=READ_S / 2)
        assert refused.status_code == 503, refused.text
        assert "--limit-concurrency" in refused.json()["error"]["message"]
        assert refused.headers["access-control-allow-origin"] == GOOD  # the page can read why
        assert httpx.get(f"{server.url}/health", timeout=WAIT_S).status_code == 200  # never refused
    finally:
        for sock in held:
            sock.close()
    answer = _complete_until(server, lambda status: status != 503, within=WAIT_S)  # they end at the close
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 2


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


def test_cors_preflight_and_headers_follow_the_flags(server):
    url = f"{server.url}/v1/chat/completions"
    good = httpx.options(url, headers={"Origin": GOOD, **PREFLIGHT}, timeout=WAIT_S)
    assert good.status_code == 200
    assert good.headers["access-control-allow-origin"] == GOOD
    assert good.headers["access-control-allow-credentials"] == "true"
    assert set(good.headers["access-control-allow-methods"].replace(" ", "").split(",")) >= {"GET", "POST"}
    assert "DELETE" not in good.headers["access-control-allow-methods"]
    evil = httpx.options(url, headers={"Origin": "http://evil.example", **PREFLIGHT}, timeout=WAIT_S)
    assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers
    plain = httpx.get(f"{server.url}/v1/models", headers={"Origin": GOOD}, timeout=WAIT_S)
    assert plain.status_code == 200 and plain.headers["access-control-allow-origin"] == GOOD
    other = httpx.get(f"{server.url}/v1/models", headers={"Origin": "http://evil.example"}, timeout=WAIT_S)
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_http_flags_default_as_vllm():
    from vllmpy.entrypoints.openai.api_server import build_parser

    args = build_parser().parse_args([])
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers) == (["*"], ["*"], ["*"])
    assert args.allow_credentials is False and args.limit_concurrency is None
    assert args.timeout_keep_alive == 5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--allowed-origins", "*"])  # vLLM's flags take a JSON list
