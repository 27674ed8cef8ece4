"""Architecture name (config.json `architectures[0]`) → model class, imported lazily."""
from __future__ import annotations

import importlib

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.models.base import CausalLM

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "PhiForCausalLM": ("phi", "PhiForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "StableLmForCausalLM": ("stablelm", "StableLmForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Olmo3ForCausalLM": ("olmo2", "Olmo3ForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "Glm4ForCausalLM": ("glm4", "Glm4ForCausalLM"),
    "CohereForCausalLM": ("cohere", "CohereForCausalLM"),
    "Cohere2ForCausalLM": ("cohere", "Cohere2ForCausalLM"),
    "InternLM3ForCausalLM": ("internlm3", "InternLM3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(config: dict) -> type[CausalLM]:
    archs = config.get("architectures") or []
    if not archs:
        raise UnsupportedCheckpointError(
            "config.json has no 'architectures' entry; supported architectures: "
            + ", ".join(supported_architectures()))
    arch = archs[0]
    if arch not in _MODELS:
        raise UnsupportedCheckpointError(
            f"architecture {arch!r} is not supported; supported architectures: "
            + ", ".join(supported_architectures()))
    module, cls = _MODELS[arch]
    return getattr(importlib.import_module(f"vllmpy.models.{module}"), cls)
