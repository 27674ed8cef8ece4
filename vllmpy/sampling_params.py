"""vLLM's SamplingParams: same field names, same meaning, validated at construction."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllmpy.structured_output.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "SamplingParams", "StructuredOutputsParams"]

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling controls. temperature 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    extra_args: dict[str, Any] = field(default_factory=dict)
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name; moved to structured_outputs
    # Per-request (output_token_ids, logits[V]) -> logits[V], or (prompt_ids, output_ids, logits) as vLLM v0.
    logits_processors: list[Callable[..., Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.top_k == -1:  # vLLM quietly accepts -1 for "disabled" but prefers 0
            self.top_k = 0
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("set structured_outputs or its old name guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        self.logits_processors = list(self.logits_processors or [])
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> None:
            raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if self.n < 1:
            bad("n", ">= 1")
        if self.temperature < 0:
            bad("temperature", ">= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if self.top_k < 0:
            bad("top_k", "0 (disable), or at least 1 (-1 also disables)")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", ">= 1 (or None for 'until max_model_len')")
        if self.min_tokens < 0:
            bad("min_tokens", ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "in [-2, 2]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "> 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            bad("prompt_logprobs", ">= 0, or -1 for the whole vocabulary")
        if self.logprobs is not None and self.logprobs < -1:
            bad("logprobs", ">= 0, or -1 for the whole vocabulary")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "token ids >= 0")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "a StructuredOutputsParams")
        if not all(callable(fn) for fn in self.logits_processors):
            bad("logits_processors", "a list of callables (output_token_ids, logits) -> logits")

    def check_logprobs_limit(self, max_logprobs: int, vocab_size: int) -> None:
        """Refuse logprobs / prompt_logprobs above the engine's --max-logprobs (-1 there: the whole
        vocabulary) or above the vocabulary itself; -1 here asks for the whole vocabulary."""
        limit = vocab_size if max_logprobs == -1 else max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(self, name)
            if asked is None:
                continue
            wanted = vocab_size if asked == -1 else asked
            if wanted > vocab_size:
                raise ValueError(f"{name} must be at most the vocabulary size ({vocab_size}), got {asked}")
            if wanted > limit:
                what = "the whole vocabulary (-1)" if asked == -1 else asked
                raise ValueError(f"{name} asks for {what} but the engine allows at most {limit} (--max-logprobs "
                                 f"{max_logprobs}); ask for fewer, or start the engine with a larger --max-logprobs "
                                 f"(-1 allows the whole vocabulary)")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **overrides: Any) -> "SamplingParams":
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        data.update(overrides)
        return SamplingParams(**data)
