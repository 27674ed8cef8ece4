"""Our own /openapi.json tells the truth. schemathesis against it on a real server: requests generated
from the schema, valid ones and invalid ones, never get a 5xx, and the server is healthy afterwards; the
routes it declares behave as declared (/health's two answers, models.retrieve, 405 with Allow).

Bounded so it stays fast on a 2-core machine: a fixed number of examples per operation and mode, a fixed
seed, no shrinking, and a server whose context (--max-model-len 64) and batch (--max-num-seqs 4) bound
what any request can ask. (schemathesis' own pytest loader for a schema known only at run time,
`from_fixture`, does not run under pytest 9, so the operations are walked here.)"""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import APIOperation, Case, GenerationMode
from schemathesis.checks import not_a_server_error

from tests.server.conftest import ServerProcess

EXAMPLES_PER_OPERATION = 25
MODEL = "model"
SLASHED = "org/tiny-llama"  # served names may hold a slash; the openai client sends it unescaped
# Routes the schema must hold (a schema that lost them would make this test pass vacuously).
EXPECTED = {"GET /health", "GET /v1/models", "GET /v1/models/{model}", "POST /v1/completions",
            "POST /v1/chat/completions", "POST /v1/embeddings", "POST /tokenize", "POST /detokenize", "POST /v1/responses",
            "GET /v1/responses/{response_id}", "POST /v1/messages", "POST /v1/messages/count_tokens",
            "POST /score", "POST /v1/score", "POST /rerank", "POST /v1/rerank", "POST /v2/rerank", "POST /classify",
            "POST /pooling"}


@pytest.fixture(scope="module")
def fuzzed_server(tiny_llama_dir):
    server = ServerProcess("--model", tiny_llama_dir, "--served-model-name", MODEL, SLASHED, "--num-blocks", "64",
                           "--max-model-len", "64", "--max-num-seqs", "4")
    yield server
    server.stop()


def _served_model(case: Case) -> Case:
    """A valid body names the served model, so that it gets past the model check into the engine."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL
    return case


def _fuzz(operation: APIOperation, mode: GenerationMode, base_url: str) -> None:
    strategy = operation.as_strategy(generation_mode=mode)

    @given(case=strategy.map(_served_model) if mode is GenerationMode.POSITIVE else strategy)
    @settings(max_examples=EXAMPLES_PER_OPERATION, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case: Case) -> None:
        case.call_and_validate(base_url=base_url, checks=[not_a_server_error], timeout=30)

    run()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_from_the_schema_gets_a_5xx(fuzzed_server, mode):
    schema = schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")
    failures, labels = {}, set()
    for result in schema.get_all_operations():
        operation = result.ok()
        labels.add(operation.label)
        try:
            _fuzz(operation, mode, fuzzed_server.url)
        except Unsatisfiable:  # nothing in this operation can be made invalid (no body, no query)
            assert mode is GenerationMode.NEGATIVE, operation.label
        except Exception as exc:  # collected, so that one failing route does not hide the others
            failures[operation.label] = exc
    assert EXPECTED <= labels, f"missing from /openapi.json: {sorted(EXPECTED - labels)}"
    assert not failures, "\n\n".join(f"{label}: {exc}" for label, exc in failures.items())


def test_healthy_after_fuzzing(fuzzed_server):
    assert httpx.get(f"{fuzzed_server.url}/health", timeout=10).status_code == 200
    answer = httpx.post(f"{fuzzed_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


def test_models_retrieve_as_the_openai_client(fuzzed_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{fuzzed_server.url}/v1", api_key="unused", max_retries=0)
    for name in (MODEL, SLASHED):
        card = client.models.retrieve(name)
        assert (card.id, card.object) == (name, "model")
    with pytest.raises(openai.NotFoundError) as refused:
        client.models.retrieve("no-such-model")
    assert refused.value.body["param"] == "model" and "no-such-model" in refused.value.body["message"]


def test_health_declares_both_answers(fuzzed_server):
    spec = httpx.get(f"{fuzzed_server.url}/openapi.json", timeout=10).json()
    answers = spec["paths"]["/health"]["get"]["responses"]
    assert "content" not in answers["200"]  # an empty body, as vLLM's
    assert answers["503"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert httpx.get(f"{fuzzed_server.url}/health", timeout=10).content == b""


def test_undeclared_method_is_405_with_allow(fuzzed_server):
    answer = httpx.request("TRACE", f"{fuzzed_server.url}/v1/completions", timeout=10)
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"
    assert answer.json()["error"]["code"] == 405


def test_schema_declares_the_engine_bounds(fuzzed_server):
    """n, logprobs, truncation and token ids carry this server's bounds (--max-num-seqs 4, --max-logprobs 20,
    --max-model-len 64, the vocabulary): the largest declared token id is served and the next one refused."""
    components = httpx.get(f"{fuzzed_server.url}/openapi.json", timeout=10).json()["components"]["schemas"]
    completion = components["CompletionRequest"]["properties"]

    def integer(prop: dict) -> dict:
        return next(branch for branch in prop["anyOf"] if branch.get("type") == "integer")

    assert integer(completion["n"])["maximum"] == 4
    assert (integer(completion["logprobs"])["minimum"], integer(completion["logprobs"])["maximum"]) == (0, 20)
    assert integer(components["ChatCompletionRequest"]["properties"]["top_logprobs"])["maximum"] == 20
    assert integer(components["EmbeddingRequest"]["properties"]["truncate_prompt_tokens"])["maximum"] == 64
    token_ids = next(branch for branch in completion["prompt"]["anyOf"]
                     if branch.get("type") == "array" and branch["items"].get("type") == "integer")
    largest = token_ids["items"]["maximum"]
    too_big = httpx.post(f"{fuzzed_server.url}/v1/completions", json={"prompt": [largest + 1], "max_tokens": 1},
                         timeout=10)
    fits = httpx.post(f"{fuzzed_server.url}/v1/completions", json={"prompt": [largest], "max_tokens": 1}, timeout=30)
    assert too_big.status_code == 400 and fits.status_code == 200
