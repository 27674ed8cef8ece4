"""Architecture name (config.json `architectures[0]`) → model class, imported lazily; out-of-tree
architectures join through ModelRegistry.register_model (vLLM's plugin seam, see vllmpy.plugins)."""
from __future__ import annotations

import importlib

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.models.adapters import PoolingModel, as_embedding_model
from vllmpy.models.base import CausalLM
from vllmpy.plugins import load_general_plugins

# The engine tasks that pool hidden states instead of sampling (the runner's Pooler is set).
POOLING_TASKS = ("embed", "classify")

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "Idefics3ForConditionalGeneration": ("idefics3", "Idefics3ForConditionalGeneration"),
    "SmolVLMForConditionalGeneration": ("idefics3", "Idefics3ForConditionalGeneration"),
    "Mistral3ForConditionalGeneration": ("mistral3", "Mistral3ForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
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
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "Glm4MoeLiteForCausalLM": ("deepseek_v2", "Glm4MoeLiteForCausalLM"),
    "MiniCPM3ForCausalLM": ("minicpm3", "MiniCPM3ForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5_vl", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForCausalLM": ("qwen3_next", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_vl", "Qwen3_5MoeForConditionalGeneration"),
    "Lfm2ForCausalLM": ("lfm2", "Lfm2ForCausalLM"),
    "Mamba2ForCausalLM": ("mamba2", "Mamba2ForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granite_hybrid", "GraniteMoeHybridForCausalLM"),
    "BambaForCausalLM": ("granite_hybrid", "BambaForCausalLM"),
    "NemotronHForCausalLM": ("nemotron_h", "NemotronHForCausalLM"),
    "FalconH1ForCausalLM": ("falcon_h1", "FalconH1ForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "GraniteMoeForCausalLM": ("granite_moe", "GraniteMoeForCausalLM"),
    "Exaone4ForCausalLM": ("exaone4", "Exaone4ForCausalLM"),
    "SeedOssForCausalLM": ("seed_oss", "SeedOssForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("ernie45_moe", "Ernie4_5_MoeForCausalLM"),
    "Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "Llama4ForCausalLM": ("llama4", "Llama4ForCausalLM"),
}


# Embedding-only architectures: encoders with a class of their own, and bare decoders (no LM head,
# tensors named without `model.`) served by their causal family's class as an embedding model.
_EMBEDDING_MODELS: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", "BertModel"),
    "RobertaModel": ("roberta", "RobertaModel"),
    "XLMRobertaModel": ("roberta", "XLMRobertaModel"),
}
_BARE_DECODERS: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
# Sequence classifiers / cross-encoders (task classify): encoders with a head of their own, and decoder
# families with transformers' `score` head on the last token.
_CLASSIFIERS: dict[str, tuple[str, str]] = {
    name: ("sequence_classification", name) for name in (
        "BertForSequenceClassification", "RobertaForSequenceClassification", "XLMRobertaForSequenceClassification")
}
_DECODER_CLASSIFIERS: dict[str, str] = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}


class _ModelRegistry:
    """vLLM's ModelRegistry: a package adds (or replaces) an architecture without editing vllmpy."""

    def __init__(self) -> None:
        self._models: dict[str, type[CausalLM] | str] = {}

    def register_model(self, architecture: str, model_cls: type[CausalLM] | str) -> None:
        """`model_cls`: the class, or "package.module:ClassName", imported when a checkpoint names it."""
        if isinstance(model_cls, str):
            module, _, name = model_cls.partition(":")
            if not module or not name:
                raise ValueError(f"model_cls must be a class or 'module:ClassName', got {model_cls!r}")
        elif not (isinstance(model_cls, type) and issubclass(model_cls, CausalLM)):
            raise ValueError(f"model_cls must be a vllmpy.models.base.CausalLM subclass or 'module:ClassName', "
                             f"got {model_cls!r}")
        self._models[architecture] = model_cls

    def get_supported_archs(self) -> list[str]:
        return supported_architectures()

    def __contains__(self, architecture: str) -> bool:
        return architecture in self._models

    def load(self, architecture: str) -> type[CausalLM]:
        target = self._models[architecture]
        if isinstance(target, type):
            return target
        module, _, name = target.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise UnsupportedCheckpointError(f"architecture {architecture!r} is registered as {target!r}, which "
                                             f"cannot be imported: {type(exc).__name__}: {exc}") from None


ModelRegistry = _ModelRegistry()


def supported_architectures() -> list[str]:
    return sorted({*_MODELS, *_EMBEDDING_MODELS, *_BARE_DECODERS, *_CLASSIFIERS, *_DECODER_CLASSIFIERS,
                   *ModelRegistry._models})


def _architecture(config: dict) -> str:
    load_general_plugins()  # at engine start, before the first lookup: plugins may register architectures
    archs = config.get("architectures") or []
    if not archs:
        raise UnsupportedCheckpointError(
            "config.json has no 'architectures' entry; supported architectures: "
            + ", ".join(supported_architectures()))
    arch = archs[0]
    if arch not in supported_architectures():
        raise UnsupportedCheckpointError(
            f"architecture {arch!r} is not supported; supported architectures: "
            + ", ".join(supported_architectures()))
    return arch


def _own_task(arch: str) -> str:
    """What the architecture does when --task is auto."""
    if arch in ModelRegistry:
        cls = ModelRegistry.load(arch)
        if hasattr(cls, "classify"):
            return "classify"
        return "embed" if issubclass(cls, PoolingModel) else "generate"
    if arch in _MODELS:
        return "generate"
    return "classify" if arch in _CLASSIFIERS or arch in _DECODER_CLASSIFIERS else "embed"


def resolve_task(config: dict, task: str = "auto") -> str:
    """"generate", "embed" or "classify": `task` unless "auto", else what the architecture does. A
    generative model may embed (its head dropped); nothing else changes task."""
    arch = _architecture(config)
    own = _own_task(arch)
    if task in ("auto", own) or (own, task) == ("generate", "embed"):
        return own if task == "auto" else task
    kinds = {"generate": "a generative", "embed": "an embedding", "classify": "a classification"}
    raise UnsupportedCheckpointError(f"architecture {arch!r} is {kinds[own]} model: it cannot serve --task "
                                     f"{task}; serve it with --task {own}")


def _load(module: str, cls: str) -> type[CausalLM]:
    return getattr(importlib.import_module(f"vllmpy.models.{module}"), cls)


def resolve_model_class(config: dict, task: str = "auto") -> type[CausalLM]:
    """The class for config.json's architecture; with task "embed" a decoder loses its LM head."""
    arch = _architecture(config)
    task = resolve_task(config, task)
    if arch in ModelRegistry:
        model_cls = ModelRegistry.load(arch)
    elif arch in _EMBEDDING_MODELS:
        return _load(*_EMBEDDING_MODELS[arch])
    elif arch in _CLASSIFIERS:
        return _load(*_CLASSIFIERS[arch])
    elif arch in _DECODER_CLASSIFIERS:
        from vllmpy.models.sequence_classification import as_seq_cls_model

        return as_seq_cls_model(_load(*_MODELS[_DECODER_CLASSIFIERS[arch]]))
    elif arch in _BARE_DECODERS:
        return as_embedding_model(_load(*_MODELS[_BARE_DECODERS[arch]]), "model.")
    else:
        model_cls = _load(*_MODELS[arch])
    if task == "embed" and not issubclass(model_cls, PoolingModel):
        return as_embedding_model(model_cls)
    return model_cls
