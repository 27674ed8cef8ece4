"""POST /v1/embeddings on all-MiniLM-L6-v2 in a real server subprocess, through the official openai client
(float and base64) and raw HTTP for the refusals: each a 400 naming the field, the server serving on."""
from __future__ import annotations

import base64
import struct

import pytest
import torch
from torch.nn import functional as F

from tests.models.test_embeddings import COSINE_MIN, TEXTS, sentence_transformers_reference
from tests.server.conftest import ServerProcess

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

EMBED = {"model": "minilm", "input": "Hello world"}


@pytest.fixture(scope="module")
def minilm_server(minilm_path):
    server = ServerProcess("--model", minilm_path, "--served-model-name", "minilm")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(minilm_server):
    return openai.OpenAI(base_url=f"{minilm_server.url}/v1", api_key="unused", max_retries=0)


def test_float_embeddings_match_transformers(client, minilm_path):
    response = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    ref, ref_ids = sentence_transformers_reference(minilm_path, TEXTS)
    assert [d.index for d in response.data] == list(range(len(TEXTS)))
    cosines = [float(F.cosine_similarity(torch.tensor(d.embedding), r, dim=0)) for d, r in zip(response.data, ref)]
    assert min(cosines) >= COSINE_MIN
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(len(i) for i in ref_ids)
    assert response.model == "minilm" and response.object == "list"


def test_base64_is_little_endian_float32_of_the_same_vectors(client):
    floats = client.embeddings.create(model="minilm", input=TEXTS[:2], encoding_format="float").data
    raw = client.embeddings.create(model="minilm", input=TEXTS[:2], encoding_format="base64").data
    decoded_by_client = client.embeddings.create(model="minilm", input=TEXTS[:2]).data  # asks base64, decodes
    for f, r, d in zip(floats, raw, decoded_by_client):
        data = base64.b64decode(r.embedding)
        vector = struct.unpack(f"<{len(data) // 4}f", data)
        assert len(vector) == 384
        assert max(abs(a - b) for a, b in zip(vector, f.embedding)) < 1e-6
        assert max(abs(a - b) for a, b in zip(d.embedding, f.embedding)) < 1e-6


def test_token_id_inputs_and_truncation(client):
    text = client.embeddings.create(model="minilm", input="Hello world", encoding_format="float")
    ids = client.embeddings.create(model="minilm", input=[101, 7592, 2088, 102], encoding_format="float")
    many = client.embeddings.create(model="minilm", input=[[101, 7592, 2088, 102], [101, 102]], encoding_format="float")
    assert max(abs(a - b) for a, b in zip(text.data[0].embedding, ids.data[0].embedding)) < 1e-5
    assert len(many.data) == 2 and many.usage.prompt_tokens == 6
    long = client.embeddings.create(model="minilm", input="word " * 1000, encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": 16})
    assert long.usage.prompt_tokens == 16


REFUSALS = [
    # (route, body, param)
    ("/v1/embeddings", {**EMBED, "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {**EMBED, "dimensions": 16}, "dimensions"),
    ("/v1/embeddings", {**EMBED, "input": ""}, "input"),
    ("/v1/embeddings", {**EMBED, "input": []}, "input"),
    ("/v1/embeddings", {**EMBED, "input": ["ok", ""]}, "input"),
    ("/v1/embeddings", {**EMBED, "input": [101, 10**7, 102]}, "input"),
    ("/v1/embeddings", {**EMBED, "input": [[101, 102], [-1]]}, "input"),
    ("/v1/embeddings", {**EMBED, "input": "word " * 1000}, "input"),
    ("/v1/embeddings", {**EMBED, "input": 5}, "input"),
    ("/v1/embeddings", {**EMBED, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {"model": "minilm", "prompt": "Hello", "max_tokens": 2}, "model"),
]


@pytest.mark.parametrize("route,body,param", REFUSALS, ids=[f"{r}:{p}" for r, _, p in REFUSALS])
def test_refusals_are_400s_naming_the_field(minilm_server, route, body, param):
    response = httpx.post(minilm_server.url + route, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError", error
    after = httpx.post(minilm_server.url + "/v1/embeddings", json=EMBED, timeout=60)
    assert after.status_code == 200 and len(after.json()["data"][0]["embedding"]) == 384


def test_generative_model_refuses_embeddings(tiny_server):
    response = httpx.post(tiny_server.url + "/v1/embeddings", json={"model": "model", "input": "hi"}, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model"
    assert "--task embed" in response.json()["error"]["message"]
