"""The names a request's `model` may hold: the served base names and the LoRA adapters (vLLM's
OpenAIServingModels): `--lora-modules` at start, POST /v1/load_lora_adapter and /v1/unload_lora_adapter at run
time when VLLM_ALLOW_RUNTIME_LORA_UPDATING is set (as vLLM, the routes do not exist otherwise)."""
from __future__ import annotations

import argparse
import itertools
import json
import os
from dataclasses import dataclass
from http import HTTPStatus

from pydantic import BaseModel

from vllmpy.engine.async_llm import AsyncLLM
from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.entrypoints.openai.protocol import ModelCard, ModelList
from vllmpy.lora.request import LoRARequest

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    """vLLM's reading of the variable: "1" or "true" (any case) turns the load / unload routes on."""
    return os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """An argparse type for --lora-modules: `name=path`, or vLLM's JSON form
    '{"name": ..., "path": ..., "base_model_name": ...}'."""
    if value.lstrip().startswith("{"):
        try:
            data = json.loads(value)
            return LoRAModulePath(data["name"], data["path"], data.get("base_model_name"))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules JSON needs \"name\" and \"path\" strings: {exc}") from exc
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes name=path or JSON, got {value!r}")
    return LoRAModulePath(name, path)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_int_id: int | None = None


class ServingModels:
    def __init__(self, engine: AsyncLLM, base_names: list[str], model_root: str, max_model_len: int) -> None:
        self.engine = engine
        self.base_names = base_names
        self.model_root = model_root
        self.max_model_len = max_model_len
        self.lora_requests: dict[str, LoRARequest] = {}  # by name, in load order
        self._ids = itertools.count(1)

    def load_static(self, modules: list[LoRAModulePath]) -> None:
        """--lora-modules, loaded (and checked) before the server accepts a request; raises naming the adapter."""
        for module in modules:
            request = LoRARequest(module.name, next(self._ids), module.path, module.base_model_name)
            self.engine.engine.add_lora(request)
            self.lora_requests[module.name] = request

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names, None for a base name (or none given); 404 for any other."""
        if model is None or model in self.base_names:
            return None
        if model in self.lora_requests:
            return self.lora_requests[model]
        raise RequestError(f"The model `{model}` does not exist.", "model", HTTPStatus.NOT_FOUND)

    def model_list(self) -> ModelList:
        cards = [ModelCard(id=name, root=self.model_root, max_model_len=self.max_model_len) for name in self.base_names]
        cards += [ModelCard(id=lora.lora_name, root=lora.lora_path, parent=lora.base_model_name or self.base_names[0],
                            max_model_len=self.max_model_len) for lora in self.lora_requests.values()]
        return ModelList(data=cards)

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        if not body.lora_name or not body.lora_path:
            raise RequestError("Both 'lora_name' and 'lora_path' must be provided.", None)
        if body.lora_name in self.lora_requests or body.lora_name in self.base_names:
            raise RequestError(f"The lora adapter '{body.lora_name}' has already been loaded.", "lora_name")
        request = LoRARequest(body.lora_name, next(self._ids), body.lora_path)
        try:
            await self.engine.add_lora(request)
        except ValueError as exc:
            raise RequestError(str(exc), "lora_path") from exc
        self.lora_requests[body.lora_name] = request
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        if not body.lora_name:
            raise RequestError("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
        request = self.lora_requests.pop(body.lora_name, None)
        if request is None:
            raise RequestError(f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name",
                               HTTPStatus.NOT_FOUND)
        await self.engine.remove_lora(request.lora_int_id)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
