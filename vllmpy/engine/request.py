"""A request as the engine tracks it: tokens, progress, status."""
from __future__ import annotations

import enum
import time

from vllmpy.lora.request import LoRARequest
from vllmpy.multimodal.inputs import ImageFeature, image_hashes
from vllmpy.pooling_params import PoolingParams
from vllmpy.sampling_params import SamplingParams
from vllmpy.tokenizer import IncrementalDetokenizer


class RequestStatus(enum.IntEnum):
    """Ordered so that `status >= FINISHED_STOPPED` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class RequestKind(enum.Enum):
    """What the engine does with a request: sample tokens after its prompt, or pool the prompt's hidden
    states (it finishes after the step that computes its last prompt token)."""

    GENERATE = "generate"
    POOL = "pool"


class Request:
    """One sequence being generated (n > 1 is fanned out into n Requests above the engine), or one prompt
    being pooled (`kind` POOL: `sampling_params` is None and `pooling_params` is set)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        eos_token_ids: set[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        max_tokens: int | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list[ImageFeature] | None = None,
    ) -> None:
        self.request_id = request_id
        # The prompt's images in prompt order: their placeholder spans, pixels and content hashes.
        self.mm_features: list[ImageFeature] = list(mm_features or ())
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.lora_request = lora_request  # the adapter it runs on (None: the base model)
        self.kind = RequestKind.POOL if pooling_params is not None else RequestKind.GENERATE
        if (sampling_params is None) == (self.kind is RequestKind.GENERATE):
            raise ValueError(f"request {request_id!r}: give sampling_params to generate or pooling_params "
                             f"to pool, exactly one of them")
        self.eos_token_ids = set(eos_token_ids or ())
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        # Resolved output budget (sampling_params.max_tokens or what max_model_len leaves).
        if max_tokens is None:
            max_tokens = sampling_params.max_tokens if self.kind is RequestKind.GENERATE else 0
        self.max_tokens = max_tokens
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling; -1 until then
        self.num_preemptions = 0
        # Speculative decoding: draft tokens verified for this request, and how many of them were kept.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # The generated text so far, advanced by the core's stop pass (stop strings are matched on it);
        # None for a pooling request or one the core has not admitted yet.
        self.detokenizer: IncrementalDetokenizer | None = None
        self.output_text_len: int | None = None  # a stop string's cut: the visible text ends here

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def block_extra_keys(self) -> tuple:
        """What its KV depends on besides the tokens (the prefix cache's extra hash keys): the adapter."""
        lora = self.lora_request
        return () if lora is None else ("lora", lora.lora_int_id, lora.lora_name)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def image_keys(self, start: int, end: int) -> tuple:
        """Extra hash keys of the KV block holding positions [start, end): the images it shows."""
        return image_hashes(self.mm_features, start, end) if self.mm_features else ()

    @property
    def is_pooling(self) -> bool:
        return self.kind is RequestKind.POOL

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
