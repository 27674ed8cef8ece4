"""`--kv-cache-dtype`: vLLM's names (plus int8) -> the storage dtype the cache is sized and written in.

`auto` (the default, as in vLLM) takes a checkpoint's declared KV quantization (`kv_cache_quant_algo` /
`kv_cache_scheme` in config.json's quantization_config, or in a standalone hf_quant_config.json when
config.json has none), else the model dtype. Any other value is explicit and always wins.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllmpy.attention.kv_storage import FP8_DTYPES, int8_group
from vllmpy.config import check_kv_cache_dtype

if TYPE_CHECKING:
    from vllmpy.attention.layer import PagedAttention

logger = logging.getLogger("vllmpy")

STORED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
          "int8": torch.int8}
MODEL_DTYPE = "auto: the model dtype"  # the source of an auto that nothing was declared for
_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
          torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2", torch.int8: "int8"}


@dataclass(frozen=True)
class KVCacheDtype:
    requested: str  # the flag's value
    dtype: torch.dtype  # what the cache stores
    source: str  # why: the flag, the model dtype, or the checkpoint's declaration

    @property
    def name(self) -> str:
        return _NAMES[self.dtype]

    def describe(self, head_dim: int) -> str:
        """The header's resolved-storage value: the name and what a value costs."""
        if self.dtype == torch.int8:
            return f"int8 (1-byte pages, an fp16 scale per {int8_group(head_dim)} values)"
        return f"{self.name} ({self.dtype.itemsize}-byte pages)"

    @property
    def per_tensor_scaled(self) -> bool:
        return self.dtype in FP8_DTYPES


def declared_kv_dtype(checkpoint_dir: str | None, config: dict) -> tuple[str, str] | None:
    """(cache dtype name, where it was declared) from the checkpoint's quantization config, or None.

    config.json's quantization_config counts whenever present (a stale hf_quant_config.json beside it is
    ignored, as vLLM does); the standalone hf_quant_config.json (ModelOpt <= 0.29) only without it."""
    inline = config.get("quantization_config")
    if isinstance(inline, dict):
        found = _kv_algo(inline)
        return None if found is None else (found, "config.json quantization_config")
    legacy = os.path.join(checkpoint_dir or "", "hf_quant_config.json")
    if checkpoint_dir and os.path.isfile(legacy):  # a GGUF file's path joins to no file
        with open(legacy) as f:
            found = _kv_algo(json.load(f))
        if found is not None:
            return found, "hf_quant_config.json"
    return None


def _kv_algo(quant: dict) -> str | None:
    """The declared KV algorithm as a cache dtype name ('auto' for one we do not store), or None."""
    inner = quant.get("quantization") if isinstance(quant.get("quantization"), dict) else {}
    algo = next((d.get(key) for key in ("kv_cache_scheme", "kv_cache_quant_algo") for d in (inner, quant)
                 if d.get(key)), None)
    if algo is None:
        return None
    if isinstance(algo, dict):  # compressed-tensors: {"num_bits": 8, "type": "float", ...}
        algo = "fp8" if algo.get("num_bits") == 8 and algo.get("type") == "float" else json.dumps(algo)
    return {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "int8": "int8"}.get(
        str(algo).lower(), f"auto (declared {algo!r} is not a KV format stored here)")


def resolve_kv_cache_dtype(requested: str, model_dtype: torch.dtype, checkpoint_dir: str | None,
                           config: dict) -> KVCacheDtype:
    """The flag when explicit; for auto the checkpoint's declaration, else the model dtype."""
    check_kv_cache_dtype(requested)
    if requested != "auto":
        return KVCacheDtype(requested, STORED[requested], f"--kv-cache-dtype {requested}")
    declared = declared_kv_dtype(checkpoint_dir, config)
    if declared is not None and declared[0] in STORED:
        return KVCacheDtype(requested, STORED[declared[0]], f"kv_cache_quant_algo in {declared[1]}")
    why = f"; {declared[0]} in {declared[1]}" if declared is not None else ""
    return KVCacheDtype(requested, model_dtype, f"{MODEL_DTYPE}{why}")


def announce_kv_cache_dtype(kv: KVCacheDtype, layers: Sequence[PagedAttention]) -> None:
    """One line naming what a checkpoint's declaration resolved to (one we do not store too), and one saying
    when an fp8 cache runs on the default scale 1.0 because the checkpoint ships no k_scale / v_scale."""
    if kv.requested == "auto" and kv.source != MODEL_DTYPE:
        logger.info("KV cache dtype: %s resolved from %s (--kv-cache-dtype %s)", kv.name, kv.source, kv.requested)
    if kv.per_tensor_scaled:
        missing = sum(not layer.kv_scale_loaded for layer in layers)
        if missing:
            logger.warning("%s KV cache: the checkpoint ships no k_scale/v_scale for %d of %d attention layers; "
                           "those use the default scale 1.0", kv.name, missing, len(layers))
