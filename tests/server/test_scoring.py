"""/score, /v1/score, /rerank, /v1/rerank, /v2/rerank, /classify and /pooling in a real server subprocess
on a tiny random BERT cross-encoder (values vs transformers within 1e-5), plus the refusals: each a 400
naming the field, a pooling request to a generative model naming `model`."""
from __future__ import annotations

import pytest
import torch

from tests.models.test_scoring import DOCS, QUERY, TOL, reference_pairs, save_encoder
from tests.server.conftest import ServerProcess

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def cross_encoder(minilm_path, tmp_path_factory):
    path, reference = save_encoder("BertForSequenceClassification", minilm_path,
                                   tmp_path_factory.mktemp("server_ce"), num_labels=1)
    logits, ids = reference_pairs(path, reference, [(QUERY, doc) for doc in DOCS], token_types=True)
    server = ServerProcess("--model", path, "--served-model-name", "ce", "--api-key", "k")
    yield server, torch.sigmoid(logits[:, 0]).tolist(), ids
    server.stop()


@pytest.fixture(scope="module")
def http(cross_encoder):
    with httpx.Client(base_url=cross_encoder[0].url, timeout=60, headers={"Authorization": "Bearer k"}) as client:
        yield client


def _refused(response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_one_to_many_matches_transformers(http, cross_encoder, path):
    _, expected, ids = cross_encoder
    body = http.post(path, json={"model": "ce", "text_1": QUERY, "text_2": DOCS}).json()
    assert body["object"] == "list" and body["model"] == "ce" and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    assert all(d["object"] == "score" for d in body["data"])
    assert max(abs(d["score"] - e) for d, e in zip(body["data"], expected)) <= TOL
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(len(i) for i in ids)
    pairwise = http.post(path, json={"text_1": [QUERY] * 2, "text_2": DOCS[:2]}).json()["data"]
    assert max(abs(d["score"] - e) for d, e in zip(pairwise, expected[:2])) <= TOL


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_sorts_and_keeps_top_n(http, cross_encoder, path):
    _, expected, _ = cross_encoder
    order = sorted(range(len(DOCS)), key=lambda i: expected[i], reverse=True)
    body = http.post(path, json={"model": "ce", "query": QUERY, "documents": DOCS, "top_n": 2}).json()
    assert [r["index"] for r in body["results"]] == order[:2]
    assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order[:2]]
    assert max(abs(r["relevance_score"] - expected[r["index"]]) for r in body["results"]) <= TOL
    assert body["usage"]["total_tokens"] > 0
    bare = http.post(path, json={"query": QUERY, "documents": DOCS, "return_documents": False}).json()["results"]
    assert len(bare) == len(DOCS) and all("document" not in r for r in bare)


def test_classify_and_pooling(http, cross_encoder):
    _, expected, _ = cross_encoder
    pair_ids = cross_encoder[2][0]
    body = http.post("/classify", json={"model": "ce", "input": ["Hello world", "Goodbye"]}).json()
    assert [d["num_classes"] for d in body["data"]] == [1, 1] and body["data"][0]["label"] == "LABEL_0"
    assert 0 < body["data"][0]["probs"][0] < 1
    raw = http.post("/classify", json={"input": "Hello world", "use_activation": False}).json()["data"][0]
    assert abs(torch.sigmoid(torch.tensor(raw["probs"][0])).item() - body["data"][0]["probs"][0]) <= TOL
    pooled = http.post("/pooling", json={"model": "ce", "input": "Hello world"}).json()["data"][0]
    assert pooled["object"] == "pooling" and abs(pooled["data"][0] - body["data"][0]["probs"][0]) <= TOL
    # Token ids of a pair, but as one segment: no token type 1, so not the pair's score.
    single = http.post("/pooling", json={"input": pair_ids}).json()["data"][0]["data"][0]
    assert abs(single - expected[0]) > 1e-4


def test_refusals_name_the_field(http, cross_encoder):
    assert _refused(http.post("/score", json={"text_2": DOCS}), "text_1")
    assert "one to many" in _refused(http.post("/score", json={"text_1": [QUERY] * 2, "text_2": DOCS}), "text_1")
    assert _refused(http.post("/v1/rerank", json={"query": QUERY, "documents": []}), "documents")
    assert _refused(http.post("/rerank", json={"query": QUERY, "documents": DOCS, "top_n": -1}), "top_n")
    assert _refused(http.post("/v1/embeddings", json={"input": "hi"}), "model").startswith(
        "model: this is a classification model")
    assert "cut the query" in _refused(http.post(
        "/score", json={"text_1": QUERY, "text_2": DOCS, "truncate_prompt_tokens": 4}), "truncate_prompt_tokens")
    assert http.post("/score", json={"text_1": QUERY, "text_2": DOCS, "model": "nope"}).status_code == 404
    assert httpx.post(f"{cross_encoder[0].url}/score", json={"text_1": QUERY, "text_2": DOCS}).status_code == 401
    assert http.post("/score", json={"text_1": QUERY, "text_2": QUERY}).status_code == 200  # still serving


def test_generative_model_refuses_pooling_routes(tiny_server):
    for path, body in [("/score", {"text_1": QUERY, "text_2": DOCS}),
                       ("/v1/rerank", {"query": QUERY, "documents": DOCS}),
                       ("/classify", {"input": "hi"}), ("/pooling", {"input": "hi"})]:
        message = _refused(httpx.post(f"{tiny_server.url}{path}", json=body, timeout=30), "model")
        assert "generative model" in message, message


def test_embedding_model_reranks_by_cosine(minilm_path):
    from torch.nn import functional as F

    from tests.models.test_embeddings import sentence_transformers_reference

    vectors, _ = sentence_transformers_reference(minilm_path, [QUERY, *DOCS])
    expected = F.cosine_similarity(vectors[:1], vectors[1:], dim=-1).tolist()
    server = ServerProcess("--model", minilm_path, "--served-model-name", "minilm")
    try:
        body = httpx.post(f"{server.url}/v1/rerank", json={"query": QUERY, "documents": DOCS}, timeout=30).json()
        assert [r["index"] for r in body["results"]] == sorted(range(len(DOCS)), key=lambda i: -expected[i])
        assert max(abs(r["relevance_score"] - expected[r["index"]]) for r in body["results"]) <= TOL
        scores = httpx.post(f"{server.url}/score", json={"text_1": QUERY, "text_2": DOCS[0]}, timeout=30).json()
        assert abs(scores["data"][0]["score"] - expected[0]) <= TOL
        refused = httpx.post(f"{server.url}/classify", json={"input": "hi"}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
        for path, body in (("/v1/embeddings", {"input": "hi"}), ("/score", {"text_1": QUERY, "text_2": DOCS[0]})):
            too_long = httpx.post(f"{server.url}{path}", json={**body, "truncate_prompt_tokens": 2 ** 70}, timeout=30)
            assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "truncate_prompt_tokens"
    finally:
        server.stop()
