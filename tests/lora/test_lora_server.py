"""vllm-server with LoRA: adapters addressed by name through the openai client, --lora-modules at start,
load / unload at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING), /v1/models with parents, the metrics gauge."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tests.lora.adapters import ATTENTION, MLP, AdapterSpec, make_adapter
from tests.server.conftest import ServerProcess
from tests.tiny_models import make_tiny_checkpoint
from vllmpy import LLM, LoRARequest, SamplingParams

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def paths(smollm2_tokenizer_dir, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("lora_server")
    base = make_tiny_checkpoint("LlamaForCausalLM", smollm2_tokenizer_dir, out / "base")
    make_adapter(base, out / "static", AdapterSpec(8, 16, tuple(ATTENTION)), seed=1)
    make_adapter(base, out / "runtime", AdapterSpec(4, 8, tuple(MLP)), seed=2)
    return {"base": out / "base", "static": out / "static", "runtime": out / "runtime"}


@pytest.fixture(scope="module")
def server(paths):
    server = ServerProcess(
        "--model", str(paths["base"]), "--served-model-name", "model", "--num-blocks", "64", "--max-model-len", "256",
        "--enable-lora", "--max-loras", "2",
        "--lora-modules", json.dumps({"name": "static", "path": str(paths["static"]), "base_model_name": "model"}),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def expected(paths) -> dict[str | None, str]:
    """Greedy texts from the offline engine on the same adapters."""
    llm = LLM(model=str(paths["base"]), enable_lora=True, max_loras=2, num_blocks=32, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    loras = {None: None, "static": LoRARequest("static", 1, str(paths["static"])),
             "runtime": LoRARequest("runtime", 2, str(paths["runtime"]))}
    return {name: llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
            for name, lora in loras.items()}


def _complete(client, model: str):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0.0,
                                     extra_body={"ignore_eos": True})


def test_adapters_by_name_load_and_unload(server, paths, expected):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {"model", "static"} and cards["static"].parent == "model"
    assert cards["static"].root == str(paths["static"])

    response = _complete(client, "static")
    assert response.model == "static" and response.choices[0].text == expected["static"]
    assert _complete(client, "model").choices[0].text == expected[None]
    assert expected["static"] != expected[None]
    pooled = httpx.post(f"{server.url}/v1/embeddings", json={"model": "static", "input": "hi"})
    assert pooled.status_code == 400 and "`static` is a LoRA adapter" in pooled.json()["error"]["message"]

    load = httpx.post(f"{server.url}/v1/load_lora_adapter",
                      json={"lora_name": "runtime", "lora_path": str(paths["runtime"])})
    assert load.status_code == 200 and load.text == "Success: LoRA adapter 'runtime' added successfully."
    assert {card.id for card in client.models.list().data} == {"model", "static", "runtime"}
    assert _complete(client, "runtime").choices[0].text == expected["runtime"]
    chat = client.chat.completions.create(model="runtime", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0.0)
    assert chat.model == "runtime"

    again = httpx.post(f"{server.url}/v1/load_lora_adapter",
                       json={"lora_name": "runtime", "lora_path": str(paths["runtime"])})
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    bad = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(paths["base"])})
    assert bad.status_code == 400 and "has no adapter_config.json" in bad.json()["error"]["message"]

    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics

    unload = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "runtime"})
    assert unload.status_code == 200 and unload.text == "Success: LoRA adapter 'runtime' removed successfully."
    with pytest.raises(openai.NotFoundError, match="The model `runtime` does not exist"):
        _complete(client, "runtime")
    gone = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "runtime"})
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]


def test_runtime_routes_need_the_variable(paths, monkeypatch):
    """Without VLLM_ALLOW_RUNTIME_LORA_UPDATING the routes do not exist (404), as in vLLM; a --lora-modules
    entry that cannot be served is refused by name before the server starts."""
    from vllmpy.config import EngineConfig
    from vllmpy.engine.async_llm import AsyncLLM
    from vllmpy.entrypoints.openai.api_server import build_app
    from vllmpy.entrypoints.openai.serving_engine import ServingContext
    from vllmpy.entrypoints.openai.serving_models import parse_lora_module

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    engine = AsyncLLM(EngineConfig.from_kwargs(model=str(paths["base"]), enable_lora=True, num_blocks=16,
                                               max_model_len=64))
    ctx = ServingContext(engine, ["model"], str(paths["base"]))
    app = build_app(ctx)

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10) as client:
            return [await client.post(f"/v1/{route}", json={"lora_name": "x", "lora_path": str(paths["runtime"])})
                    for route in ("load_lora_adapter", "unload_lora_adapter")]

    try:
        responses = asyncio.run(main())
        with pytest.raises(ValueError, match=r"LoRA adapter 'broken'.*not a directory"):
            ctx.models.load_static([parse_lora_module(f"broken={paths['base']}/missing")])
    finally:
        engine.shutdown()
    assert [r.status_code for r in responses] == [404, 404]
