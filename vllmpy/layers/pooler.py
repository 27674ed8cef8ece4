"""Embedding pooling: one vector per prompt from its final hidden states (CLS, MEAN or LAST), then the
request's Matryoshka truncation and L2 normalization, as vLLM's embed pooler.

A classification model (one with a `classify(pooled) -> logits` head: cross-encoders, sequence
classifiers) turns the pooled vector into logits and its activation instead (vLLM's ClassifierPooler).

The pooling type comes from a sentence-transformers checkpoint's own files when present (modules.json
and its Pooling module's config.json), else from the model family (BERT: CLS, decoders: LAST).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.pooling_params import PoolingParams

POOLING_TYPES = ("CLS", "MEAN", "LAST")
# sentence-transformers Pooling config keys → our pooling type.
_ST_POOLING_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
                     "pooling_mode_lasttoken": "LAST"}
_ST = "sentence_transformers.models."
# Modules we reproduce; anything else (Dense projections, ...) would change the vector, so it is refused.
_ST_MODULES = {_ST + "Transformer", _ST + "Pooling", _ST + "Normalize"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # one of POOLING_TYPES
    normalize: bool = True

    @property
    def needs_whole_prompt(self) -> bool:
        """CLS and MEAN read every prompt position, so a prompt must be computed in one step, uncached."""
        return self.pooling_type != "LAST"


def _read_json(path: str) -> dict | list | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def pooler_config(checkpoint_dir: str, default_type: str) -> PoolerConfig:
    """The checkpoint's sentence-transformers pooling (normalize only if a Normalize module is listed,
    as vLLM reads it), else `default_type` with normalization on (vLLM's embed default)."""
    modules = _read_json(os.path.join(checkpoint_dir, "modules.json")) if os.path.isdir(checkpoint_dir) else None
    if not modules:
        return PoolerConfig(default_type)
    unknown = [m.get("type") for m in modules if m.get("type") not in _ST_MODULES]
    if unknown:
        raise UnsupportedCheckpointError(
            f"modules.json lists {', '.join(map(str, unknown))}, which is not supported; supported "
            f"sentence-transformers modules: {', '.join(sorted(_ST_MODULES))}")
    normalize = any(m["type"] == _ST + "Normalize" for m in modules)
    pooling = next((m for m in modules if m["type"] == _ST + "Pooling"), None)
    if pooling is None:
        return PoolerConfig(default_type, normalize)
    config_path = os.path.join(checkpoint_dir, pooling.get("path", ""), "config.json")
    modes = [k for k, v in (_read_json(config_path) or {}).items() if k.startswith("pooling_mode_") and v is True]
    if not modes:
        return PoolerConfig(default_type, normalize)
    if len(modes) > 1 or modes[0] not in _ST_POOLING_MODES:
        raise UnsupportedCheckpointError(
            f"{config_path}: pooling {' + '.join(modes)} is not supported; supported: exactly one of "
            f"{', '.join(_ST_POOLING_MODES)}")
    return PoolerConfig(_ST_POOLING_MODES[modes[0]], normalize)


def sentence_transformers_max_len(checkpoint_dir: str) -> int | None:
    """sentence_bert_config.json's max_seq_length, which vLLM takes as the default max_model_len."""
    config = _read_json(os.path.join(checkpoint_dir, "sentence_bert_config.json")) if os.path.isdir(
        checkpoint_dir) else None
    if not config:
        return None
    if config.get("do_lower_case"):
        raise UnsupportedCheckpointError("sentence_bert_config.json: do_lower_case=true is not supported "
                                         "(lowercase the input yourself)")
    return config.get("max_seq_length")


def matryoshka_dimensions(model_config: dict) -> list[int] | None:
    """The dimensions a Matryoshka model accepts ([] = any), or None when it is not one (vLLM's keys)."""
    dims = model_config.get("matryoshka_dimensions")
    if dims:
        return list(dims)
    return [] if model_config.get("is_matryoshka") else None


def check_dimensions(params: PoolingParams, model_config: dict, hidden_size: int) -> None:
    """Refuse `dimensions` the model does not declare, as vLLM: truncating a non-Matryoshka embedding
    silently degrades it."""
    if params.dimensions is None:
        return
    allowed = matryoshka_dimensions(model_config)
    if allowed is None:
        raise ValueError("dimensions: this model does not support Matryoshka representation (its config "
                         "declares no matryoshka_dimensions / is_matryoshka), so the output dimensions "
                         "cannot be changed")
    if allowed and params.dimensions not in allowed:
        raise ValueError(f"dimensions must be one of {allowed} for this model, got {params.dimensions}")
    if params.dimensions > hidden_size:
        raise ValueError(f"dimensions must be <= the embedding size {hidden_size}, got {params.dimensions}")


# sentence-transformers CrossEncoder activation names (config.json) → ours; vLLM reads the same keys.
_ST_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Sigmoid": "sigmoid"}


def classifier_activation(model_config: dict) -> str:
    """"identity", "sigmoid" or "softmax" for a classification model's logits: a sentence-transformers
    cross-encoder's own activation when config.json names one, else sigmoid for one label or multi-label
    problems, softmax otherwise (vLLM's choice)."""
    named = (model_config.get("sentence_transformers") or {}).get("activation_fn") or model_config.get(
        "sbert_ce_default_activation_function")
    if named is not None:
        if named not in _ST_ACTIVATIONS:
            raise UnsupportedCheckpointError(f"config.json: cross-encoder activation {named!r} is not supported; "
                                             f"supported: {', '.join(_ST_ACTIVATIONS)}")
        return _ST_ACTIVATIONS[named]
    if num_labels(model_config) == 1 or model_config.get("problem_type") == "multi_label_classification":
        return "sigmoid"
    return "softmax"


def num_labels(model_config: dict) -> int:
    """transformers' count: id2label's size, else num_labels, else its default of 2."""
    return len(model_config.get("id2label") or {}) or int(model_config.get("num_labels", 2))


def _activate(logits: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1) if kind == "softmax" else logits


def token_type_inputs(model: torch.nn.Module, token_counts: Sequence[int],
                      params: Sequence[PoolingParams | None], device: torch.device) -> dict[str, torch.Tensor]:
    """The `token_type_ids` keyword for a model that reads them (BERT): 1 from each sentence pair's
    second segment on, 0 elsewhere; {} for every other model. Encoder prompts arrive whole, one per chunk."""
    if not getattr(model, "uses_token_types", False):
        return {}
    types: list[int] = []
    for count, p in zip(token_counts, params):
        start = (p.extra_kwargs or {}).get("compressed_token_type_ids", count) if p is not None else count
        types.extend([0] * min(start, count) + [1] * max(count - start, 0))
    return {"token_type_ids": torch.tensor(types, dtype=torch.int64, device=device)}


class Pooler:
    """Final hidden states of whole prompts → one finished vector per prompt (plain lists): an embedding,
    or with `classifier` set the activated logits."""

    def __init__(self, config: PoolerConfig, classifier: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 activation: str = "softmax") -> None:
        if config.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling type must be one of {', '.join(POOLING_TYPES)}, got {config.pooling_type!r}")
        self.config = config
        self.classifier = classifier
        self.activation = activation

    def check(self, params: PoolingParams, model_config: dict, hidden_size: int) -> None:
        """Refuse what this model cannot pool: embeddings from a classifier, class scores from an embedder."""
        wanted = params.task
        if self.classifier is None and wanted in ("classify", "score"):
            raise ValueError(f"model: this is an embedding model; it has no classification head to {wanted} with "
                             f"(serve a *ForSequenceClassification checkpoint)")
        if self.classifier is not None and wanted == "score" and num_labels(model_config) != 1:
            raise ValueError(f"model: scoring needs a cross-encoder with one output label; this classifier has "
                             f"{num_labels(model_config)} (use /classify)")
        if self.classifier is not None and wanted == "embed":
            raise ValueError("model: this is a classification model; it does not serve embeddings (use "
                             "/classify, /score or /pooling)")
        if self.classifier is not None and (params.dimensions is not None or params.normalize is not None):
            raise ValueError(f"{'dimensions' if params.dimensions is not None else 'normalize'}: applies to "
                             f"embeddings, and this is a classification model")
        check_dimensions(params, model_config, hidden_size)

    def __call__(self, hidden: torch.Tensor, spans: list[tuple[int, int]],
                 params: list[PoolingParams]) -> list[list[float]]:
        """hidden: [T, H] of the flat batch; spans: each prompt's [start, end) rows in it."""
        kind = self.config.pooling_type
        if kind == "MEAN":
            pooled = torch.stack([hidden[start:end].float().mean(dim=0) for start, end in spans])
        else:
            rows = [start if kind == "CLS" else end - 1 for start, end in spans]
            pooled = hidden[torch.tensor(rows, device=hidden.device)].float()
        if self.classifier is not None:
            logits = self.classifier(pooled.to(hidden.dtype)).float()
            return [(_activate(row, self.activation) if p.use_activation is not False else row).tolist()
                    for row, p in zip(logits, params)]
        vectors = []
        for vector, p in zip(pooled, params):
            if p.dimensions is not None:
                vector = vector[:p.dimensions]
            if self.config.normalize if p.normalize is None else p.normalize:
                vector = F.normalize(vector, dim=-1)
            vectors.append(vector.tolist())
        return vectors
