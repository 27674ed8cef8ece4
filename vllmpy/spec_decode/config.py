"""`--speculative-config`: vLLM's JSON keys parsed into one frozen SpeculativeConfig, checked at startup.

Defaults follow vLLM: ngram looks up n-grams of prompt_lookup_min..prompt_lookup_max tokens (5..5 when
neither is given, the other one's value when one is), suffix drafts up to suffix_decoding_max_tree_depth
tokens, draft_model drafts with a second checkpoint (`model`; a `model` key without `method` means
draft_model, as in vLLM), greedily or sampled (`draft_sample_method`), mtp drafts with the target
checkpoint's own MTP block (k > 1 chains it, as vLLM does; the checkpoint is checked when it opens,
spec_decode/mtp.py). Methods that need heads we do not run yet parse and are refused by name, so a
vLLM command line fails here instead of running without the speculation it asked for.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from vllmpy.structured_output.params import json_object

METHODS = ("ngram", "suffix", "draft_model", "mtp")
# Parsed, then refused: what each still needs.
REFUSED_METHODS = {
    "eagle": "needs a model with EAGLE heads; none is supported yet",
    "eagle3": "needs a model with EAGLE heads; none is supported yet",
    "medusa": "needs a model with Medusa heads; none is supported yet",
}
# greedy: a draft model drafts its argmax (one-hot drafts); probabilistic (vLLM's name): it samples each draft
# from its own distribution q at the request's temperature / top-k / top-p / min-p, and the verifier accepts
# with min(1, p/q) and resamples rejections from max(p - q, 0) (spec_decode/rejection.py).
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
# Above this many running requests no request drafts: the step is then compute-bound and the drafts'
# extra query tokens cost more than the forwards they save. A stated choice for the 2-core host with the
# default model (FEATURES.md, engine.spec-decode), not a tuned optimum; more cores may afford a higher one.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None  # ngram
    prompt_lookup_max: int | None = None  # ngram
    model: str | None = None  # draft_model: an HF directory, a .gguf file or org/repo
    revision: str | None = None  # draft_model: the hub revision of `model`
    draft_tensor_parallel_size: int | None = None  # draft_model: 1 (None = 1); the draft runs in the engine's process
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    draft_sample_method: str = "greedy"
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config, its dict, or its JSON text (the flag's); None = speculation off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "--speculative-config", "the value")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls._build(dict(value))

    @classmethod
    def _build(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        method = raw.get("method")
        if raw.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling: the method as the model
            method = raw.pop("model").strip("[]") if method is None else method
        elif method is None and raw.get("model"):  # vLLM infers a draft model from a checkpoint path
            method = "draft_model"
        if method in REFUSED_METHODS:
            raise ValueError(f"--speculative-config: method {method!r} {REFUSED_METHODS[method]}")
        if method not in METHODS:
            raise ValueError(f"--speculative-config: method must be one of {', '.join(METHODS)} "
                             f"({', '.join(REFUSED_METHODS)} are not supported yet), got {method!r}")
        raw["method"] = method
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                    "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests", "disable_by_batch_size",
                    "draft_tensor_parallel_size"):
            if key in raw and raw[key] is not None:
                _check_int(key, raw[key])
        for key in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            if key in raw:
                _check_number(key, raw[key])
        if method == "ngram":
            _resolve_lookup(raw)
        elif method == "suffix":
            raw.setdefault("num_speculative_tokens", raw.get("suffix_decoding_max_tree_depth", 24))
        elif method == "draft_model" and not raw.get("model"):
            raise ValueError("--speculative-config: method 'draft_model' needs 'model' (the draft checkpoint: an "
                             "HF directory, a .gguf file or org/repo)")
        if raw.get("num_speculative_tokens") is None:
            raise ValueError(f"--speculative-config: num_speculative_tokens is required for method {method!r} "
                             f"(the most draft tokens per step, >= 1)")
        config = cls(**raw)
        config._check()
        return config

    def _check(self) -> None:
        _require(self.num_speculative_tokens >= 1, "num_speculative_tokens", ">= 1", self.num_speculative_tokens)
        _require(self.suffix_decoding_max_tree_depth >= 1, "suffix_decoding_max_tree_depth", ">= 1",
                 self.suffix_decoding_max_tree_depth)
        _require(self.suffix_decoding_max_cached_requests >= 0, "suffix_decoding_max_cached_requests", ">= 0",
                 self.suffix_decoding_max_cached_requests)
        _require(self.suffix_decoding_max_spec_factor > 0, "suffix_decoding_max_spec_factor", "> 0",
                 self.suffix_decoding_max_spec_factor)
        _require(0 <= self.suffix_decoding_min_token_prob <= 1, "suffix_decoding_min_token_prob", "in [0, 1]",
                 self.suffix_decoding_min_token_prob)
        _require(self.disable_by_batch_size >= 1, "disable_by_batch_size", ">= 1", self.disable_by_batch_size)
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"--speculative-config: draft_sample_method must be 'greedy' or 'probabilistic', got "
                             f"{self.draft_sample_method!r}")
        if self.draft_sample_method != "greedy" and self.method != "draft_model":
            raise ValueError(f"--speculative-config: draft_sample_method must be 'greedy' for method "
                             f"{self.method!r} (its drafts are lookups or an argmax); 'probabilistic' applies to "
                             f"draft_model, got {self.draft_sample_method!r}")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(f"--speculative-config: draft_tensor_parallel_size must be 1 (the draft model runs "
                             f"unsharded in the engine's process), got {self.draft_tensor_parallel_size!r}")

    def describe(self) -> str:
        """One line for logs and the bench header: the method and the keys that shape it."""
        if self.method == "ngram":
            shape = f"prompt_lookup {self.prompt_lookup_min}..{self.prompt_lookup_max}"
        elif self.method == "draft_model":
            shape = f"draft model {self.model}, {self.draft_sample_method} drafts"
        elif self.method == "mtp":
            shape = "the target's MTP block"
        else:
            shape = (f"max_tree_depth {self.suffix_decoding_max_tree_depth}, max_spec_factor "
                     f"{self.suffix_decoding_max_spec_factor}, min_token_prob {self.suffix_decoding_min_token_prob}")
        return (f"{self.method}, k={self.num_speculative_tokens}, {shape}, "
                f"disable_by_batch_size {self.disable_by_batch_size}")


def _resolve_lookup(raw: dict[str, Any]) -> None:
    """vLLM's ngram defaults: both 5, or the one given for both; then 1 <= min <= max."""
    low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = 5
    low, high = (high if low is None else low), (low if high is None else high)
    _require(low >= 1, "prompt_lookup_min", ">= 1", low)
    if high < low:
        raise ValueError(f"--speculative-config: prompt_lookup_max ({high}) must be >= prompt_lookup_min ({low})")
    raw["prompt_lookup_min"], raw["prompt_lookup_max"] = low, high


def _check_int(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"--speculative-config: {key} must be an integer, got {value!r}")


def _check_number(key: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"--speculative-config: {key} must be a number, got {value!r}")


def _require(ok: bool, key: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"--speculative-config: {key} must be {allowed}, got {value!r}")
