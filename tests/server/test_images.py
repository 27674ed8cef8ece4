"""image_url content parts over /v1/chat/completions with the official openai client: data: URLs, a
loopback http(s) URL and file:// under --allowed-local-media-path give LLM.chat's greedy text; every bad
image is a 400 naming "messages" (and the part), and a normal request is still served afterwards."""
from __future__ import annotations

import base64
import http.server
import io
import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess
from tests.vlm_models import make_tiny_gemma3_vlm, sample_image

openai = pytest.importorskip("openai")

MAX_MEDIA_BYTES = 100_000
FETCH_TIMEOUT = 1.0


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


IMAGE = sample_image(40, 24, 0)
PNG = _png(IMAGE)
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
ROUTES = {"/cat.png": ("image/png", PNG), "/page": ("text/html", b"<html></html>"),
          "/big.png": ("image/png", b"\x89PNG" + bytes(MAX_MEDIA_BYTES + 10))}


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            time.sleep(FETCH_TIMEOUT * 3)
        kind, body = ROUTES.get(self.path, ("image/png", PNG) if self.path == "/slow.png" else (None, None))
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def vlm_dir(smollm2_tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_gemma3_vlm_server")
    make_tiny_gemma3_vlm(smollm2_tokenizer_dir, out)
    return str(out)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "cat.png").write_bytes(PNG)
    (root / "secret.png").write_bytes(PNG)
    return root


@pytest.fixture(scope="module")
def vlm_server(vlm_dir, media_dir):
    server = ServerProcess("--model", vlm_dir, "--served-model-name", "model", "--num-blocks", "64",
                           "--max-model-len", "256", "--limit-mm-per-prompt", '{"image": 2}',
                           "--allowed-local-media-path", str(media_dir / "allowed"),
                           "--media-fetch-timeout", str(FETCH_TIMEOUT), "--max-media-bytes", str(MAX_MEDIA_BYTES))
    yield server
    server.stop()


def _message(*parts):
    content = [{"type": "text", "text": "Describe it."}]
    for part in parts:
        content.insert(0, part if isinstance(part, dict) else {"type": "image_url", "image_url": {"url": part}})
    return [{"role": "user", "content": content}]


def test_image_urls_match_llm_chat(vlm_server, vlm_dir, media_dir, image_host):
    from vllmpy import LLM, SamplingParams

    llm = LLM(vlm_dir, dtype="float32", num_blocks=64, max_model_len=256)
    expected = llm.chat(_message({"type": "image_pil", "image_pil": IMAGE}),
                        SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    client = openai.OpenAI(base_url=f"{vlm_server.url}/v1", api_key="unused", max_retries=0)
    for url in (DATA_URL, f"{image_host}/cat.png", (media_dir / "allowed" / "cat.png").as_uri()):
        got = client.chat.completions.create(model="model", messages=_message(url), max_tokens=12, temperature=0.0)
        assert got.choices[0].message.content == expected.outputs[0].text, url
        assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    two = client.chat.completions.create(model="model", messages=_message(DATA_URL, DATA_URL), max_tokens=4)
    assert two.usage.prompt_tokens > got.usage.prompt_tokens


def _refusals(media_dir, image_host):
    garbage = "data:image/png;base64," + base64.b64encode(b"not a png at all").decode()
    return [
        (_message(garbage), "could not be decoded"),
        (_message("data:image/png;base64,@@@"), "not valid base64"),
        (_message("data:text/plain;base64,aGk="), "not an image type"),
        (_message({"type": "video_url", "video_url": {"url": "http://x"}}), "'video_url'"),
        (_message(DATA_URL, DATA_URL, DATA_URL), "exceed the limit of 2"),
        (_message((media_dir / "secret.png").as_uri()), "outside --allowed-local-media-path"),
        (_message(f"file://{media_dir}/allowed/../secret.png"), "outside --allowed-local-media-path"),
        (_message(f"{image_host}/page"), "not an image type"),
        (_message(f"{image_host}/missing.png"), "HTTP 404"),
        (_message(f"{image_host}/big.png"), f"limit of {MAX_MEDIA_BYTES} bytes"),
        (_message(f"{image_host}/slow.png"), "timed out"),
        (_message("ftp://example.com/a.png"), "scheme 'ftp'"),
    ]


def test_bad_images_are_400s_naming_the_part(vlm_server, media_dir, image_host):
    for messages, words in _refusals(media_dir, image_host):
        response = httpx.post(f"{vlm_server.url}/v1/chat/completions", timeout=30,
                              json={"model": "model", "messages": messages, "max_tokens": 4})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "messages", (words, error)
        assert words in error["message"], (words, error)
        assert "messages[0]" in error["message"] or "video_url" in words or "limit" in words, error
    ok = httpx.post(f"{vlm_server.url}/v1/chat/completions", timeout=30,
                    json={"model": "model", "messages": _message(DATA_URL), "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_image_on_a_text_only_model(tiny_server):
    response = httpx.post(f"{tiny_server.url}/v1/chat/completions", timeout=30,
                          json={"model": "model", "messages": _message(DATA_URL), "max_tokens": 4})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "messages"
    assert "'image_url' need a multimodal model" in error["message"] and "takes text only" in error["message"]
    ok = httpx.post(f"{tiny_server.url}/v1/chat/completions", timeout=30,
                    json={"model": "model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200
