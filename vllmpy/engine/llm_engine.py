"""LLMEngine: prompts in, RequestOutputs out, one synchronous step at a time (LLM and AsyncLLM use it).

A request that fails inside a step (its forward, its stop check, its output processing) comes back
finished with finish_reason "error" and `error` naming it; the step's other requests go on.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Union

from vllmpy.config import EngineConfig
from vllmpy.distributed.config import refuse_offline_data_parallel
from vllmpy.engine.core import EngineCore
from vllmpy.engine.fault_injection import FaultInjector
from vllmpy.engine.output_processor import OutputProcessor, named_error
from vllmpy.engine.request import Request, RequestStatus
from vllmpy.lora.request import LoRARequest
from vllmpy.multimodal.inputs import ImageFeature
from vllmpy.multimodal.processor import text_only_refusal
from vllmpy.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from vllmpy.pooling_params import PoolingParams
from vllmpy.sampling_params import SamplingParams
from vllmpy.spec_decode.drafter import SpecDecodeStats

# A prompt: text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...} as vLLM accepts.
PromptType = Union[str, list[int], dict]


@dataclass
class EngineStats:
    """What the metrics endpoint exports: scheduler state plus token totals since start."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's totals; None with it off
    max_loras: int = 0  # 0: LoRA is off
    running_lora_adapters: dict[str, int] = field(default_factory=dict)  # adapter name -> requests
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    recurrent_snapshot_hits: int = 0  # prefix hits resumed from a recurrent-state snapshot (hybrid models)
    recurrent_snapshot_bytes: int = 0  # recurrent state the published snapshots hold
    recurrent_snapshots_taken: int = 0  # snapshots published since start
    recurrent_snapshot_slots: int = 0  # 0: no snapshot pool (no recurrent layers, or prefix caching off)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        refuse_offline_data_parallel(config.parallel)
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self.processor = OutputProcessor(self.tokenizer, FaultInjector.from_env())
        self._ids = itertools.count()
        self._pooling: set[str] = set()  # unfinished pooling requests (they have no OutputProcessor state)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    @property
    def default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json sampling defaults, as vLLM applies them."""
        gen = self.core.checkpoint.generation_config
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        return SamplingParams(**{k: gen[k] for k in keys if gen.get(k) is not None})

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize_prompt(self, prompt: PromptType, truncate_to: int | None = None) -> tuple[str | None, list[int]]:
        """`truncate_to`: keep the last that many tokens (a text keeps its special tokens)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _keep_last(list(prompt["prompt_token_ids"]), truncate_to)
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, truncate_to=truncate_to)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, _keep_last(list(prompt), truncate_to)
        raise TypeError("prompt must be a string, a list of token ids, or a dict with 'prompt' / 'prompt_token_ids'")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                    priority: int = 0, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a prompt to generate from (SamplingParams) or to embed (PoolingParams), as vLLM's, on the
        base model or on `lora_request`'s adapter."""
        if isinstance(params, PoolingParams):
            self._add_pooling_request(request_id, prompt, params, priority, arrival_time, lora_request)
            return
        text, token_ids, mm_features = self._prompt_inputs(prompt)
        children = []
        for i in range(params.n):
            child = params.clone(n=1, seed=None if params.seed is None else params.seed + i) if params.n > 1 else params
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            children.append(Request(child_id, token_ids, child, eos_token_ids=self.core.eos_token_ids,
                                    arrival_time=arrival_time, priority=priority, lora_request=lora_request,
                                    mm_features=mm_features))
        for child in children:
            self.core.add_request(child)  # validates; raises before anything is queued for a bad prompt
        self.processor.add(request_id, text, children)
        self.prompt_tokens_total += len(token_ids)

    def _prompt_inputs(self, prompt: PromptType) -> tuple[str | None, list[int], list[ImageFeature]]:
        """Text, token ids and the images of a prompt whose dict carries multi_modal_data (vLLM's shape)."""
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            if self.core.mm_processor is None:
                raise text_only_refusal(self.core._arch, "multi_modal_data")
            return self.core.mm_processor.process(prompt)
        return (*self.tokenize_prompt(prompt), [])

    def _add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams, priority: int,
                             arrival_time: float | None, lora_request: LoRARequest | None) -> None:
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            raise ValueError("multi_modal_data: images are served for generation only, not for pooling")
        truncate = params.truncate_prompt_tokens
        _, token_ids = self.tokenize_prompt(prompt, self.core.max_model_len if truncate == -1 else truncate)
        request = Request(request_id, token_ids, None, arrival_time=arrival_time, priority=priority,
                          pooling_params=params, lora_request=lora_request)
        self.core.add_request(request)
        self._pooling.add(request_id)
        self.prompt_tokens_total += len(token_ids)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter ahead of its requests (vLLM's add_lora); a refusal raises naming it."""
        self.core.load_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.core.lora is not None and self.core.lora.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return set() if self.core.lora is None else self.core.lora.list_loras()

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._pooling.discard(request_id)
            # A pooling request is its own core request; a generation fans out into children.
            self.core.abort_requests(self.processor.abort(request_id) or [request_id])

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        updated, runner_output, _ = self.core.step()
        parents, failed = self.processor.process(updated, runner_output)
        # Kept tokens: a verified run of drafts can bring several per step, and a stop inside it drops some.
        self.generation_tokens_total = self.processor.num_generated_tokens
        if failed:
            self.core.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        outputs: list[RequestOutput | EmbeddingRequestOutput] = []
        for parent in parents:
            outputs.append(self.processor.make_output(parent))
            if parent.finished:
                self.processor.remove(parent)
        pooled = runner_output.pooled if runner_output is not None else {}
        for request in updated:
            if request.is_finished and request.request_id in self._pooling:
                self._pooling.remove(request.request_id)
                outputs.append(EmbeddingRequestOutput(
                    request.request_id, EmbeddingOutput(pooled.get(request.request_id, [])),
                    request.prompt_token_ids,
                    error=None if request.error is None else named_error(request.request_id, request.error)))
        return outputs

    def stats(self) -> EngineStats:
        s = asdict(self.core.scheduler.stats())
        drafter = self.core.scheduler.drafter
        return EngineStats(**{k: s[k] for k in ("num_running", "num_waiting", "kv_cache_usage",
                                                 "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                                                 "running_lora_adapters", "waiting_lora_adapters",
                                                 "recurrent_snapshot_hits", "recurrent_snapshot_bytes",
                                                 "recurrent_snapshots_taken", "recurrent_snapshot_slots")},
                           max_loras=self.config.lora.max_loras if self.core.lora is not None else 0,
                           prompt_tokens_total=self.prompt_tokens_total,
                           generation_tokens_total=self.generation_tokens_total,
                           spec_decode=None if drafter is None else drafter.stats)


def _keep_last(token_ids: list[int], count: int | None) -> list[int]:
    return token_ids if count is None else token_ids[-count:]
