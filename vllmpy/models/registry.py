"""Architecture name (config.json `architectures[0]`) → model class, imported lazily."""
from __future__ import annotations

import importlib

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.models.adapters import as_embedding_model
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
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}


# Embedding-only architectures: encoders with a class of their own, and bare decoders (no LM head,
# tensors named without `model.`) served by their causal family's class as an embedding model.
_EMBEDDING_MODELS: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", "BertModel"),
}
_BARE_DECODERS: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted([*_MODELS, *_EMBEDDING_MODELS, *_BARE_DECODERS])


def _architecture(config: dict) -> str:
    archs = config.get("architectures") or []
    if not archs:
        raise UnsupportedCheckpointError(
            "config.json has no 'architectures' entry; supported architectures: "
            + ", ".join(supported_architectures()))
    arch = archs[0]
    if arch not in _MODELS and arch not in _EMBEDDING_MODELS and arch not in _BARE_DECODERS:
        raise UnsupportedCheckpointError(
            f"architecture {arch!r} is not supported; supported architectures: "
            + ", ".join(supported_architectures()))
    return arch


def resolve_task(config: dict, task: str = "auto") -> str:
    """"generate" or "embed": `task` unless "auto", else what the architecture does."""
    arch = _architecture(config)
    if task == "auto":
        return "generate" if arch in _MODELS else "embed"
    if task == "generate" and arch not in _MODELS:
        raise UnsupportedCheckpointError(f"architecture {arch!r} is an embedding model: it cannot generate "
                                         f"text (--task generate); serve it with --task embed")
    return task


def _load(module: str, cls: str) -> type[CausalLM]:
    return getattr(importlib.import_module(f"vllmpy.models.{module}"), cls)


def resolve_model_class(config: dict, task: str = "auto") -> type[CausalLM]:
    """The class for config.json's architecture; with task "embed" a decoder loses its LM head."""
    arch = _architecture(config)
    task = resolve_task(config, task)
    if arch in _EMBEDDING_MODELS:
        return _load(*_EMBEDDING_MODELS[arch])
    if arch in _BARE_DECODERS:
        return as_embedding_model(_load(*_MODELS[_BARE_DECODERS[arch]]), "model.")
    model_cls = _load(*_MODELS[arch])
    return as_embedding_model(model_cls) if task == "embed" else model_cls
