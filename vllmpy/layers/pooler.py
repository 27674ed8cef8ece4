"""Embedding pooling: one vector per prompt from its final hidden states (CLS, MEAN or LAST), then the
request's Matryoshka truncation and L2 normalization, as vLLM's embed pooler.

The pooling type comes from a sentence-transformers checkpoint's own files when present (modules.json
and its Pooling module's config.json), else from the model family (BERT: CLS, decoders: LAST).
"""
from __future__ import annotations

import json
import os
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


class Pooler:
    """Final hidden states of whole prompts → one finished embedding per prompt (plain lists)."""

    def __init__(self, config: PoolerConfig) -> None:
        if config.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling type must be one of {', '.join(POOLING_TYPES)}, got {config.pooling_type!r}")
        self.config = config

    def __call__(self, hidden: torch.Tensor, spans: list[tuple[int, int]],
                 params: list[PoolingParams]) -> list[list[float]]:
        """hidden: [T, H] of the flat batch; spans: each prompt's [start, end) rows in it."""
        kind = self.config.pooling_type
        if kind == "MEAN":
            pooled = torch.stack([hidden[start:end].float().mean(dim=0) for start, end in spans])
        else:
            rows = [start if kind == "CLS" else end - 1 for start, end in spans]
            pooled = hidden[torch.tensor(rows, device=hidden.device)].float()
        vectors = []
        for vector, p in zip(pooled, params):
            if p.dimensions is not None:
                vector = vector[:p.dimensions]
            if self.config.normalize if p.normalize is None else p.normalize:
                vector = F.normalize(vector, dim=-1)
            vectors.append(vector.tolist())
        return vectors
