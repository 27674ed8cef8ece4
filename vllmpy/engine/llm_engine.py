"""LLMEngine: prompts in, RequestOutputs out, one synchronous step at a time (LLM and AsyncLLM use it)."""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Union

from vllmpy.config import EngineConfig
from vllmpy.engine.core import EngineCore
from vllmpy.engine.output_processor import OutputProcessor
from vllmpy.engine.request import Request, RequestStatus
from vllmpy.outputs import RequestOutput
from vllmpy.sampling_params import SamplingParams

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


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
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

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError("prompt must be a string, a list of token ids, or a dict with 'prompt' / 'prompt_token_ids'")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        text, token_ids = self.tokenize_prompt(prompt)
        children = []
        for i in range(params.n):
            child = params.clone(n=1, seed=None if params.seed is None else params.seed + i) if params.n > 1 else params
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            children.append(Request(child_id, token_ids, child, eos_token_ids=self.core.eos_token_ids,
                                    arrival_time=arrival_time, priority=priority))
        for child in children:
            self.core.add_request(child)  # validates; raises before anything is queued for a bad prompt
        self.processor.add(request_id, text, children)
        self.prompt_tokens_total += len(token_ids)

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.core.abort_requests(self.processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        updated, runner_output, _ = self.core.step()
        if runner_output is not None:
            self.generation_tokens_total += sum(len(t) for t in runner_output.sampled_token_ids)
        parents, stop_hits = self.processor.process(updated, runner_output)
        if stop_hits:
            self.core.finish_requests(stop_hits, RequestStatus.FINISHED_STOPPED)
        outputs = []
        for parent in parents:
            outputs.append(self.processor.make_output(parent))
            if parent.finished:
                self.processor.remove(parent)
        return outputs

    def stats(self) -> EngineStats:
        s = asdict(self.core.scheduler.stats())
        return EngineStats(**{k: s[k] for k in ("num_running", "num_waiting", "kv_cache_usage",
                                                 "prefix_cache_queries", "prefix_cache_hits", "num_preemptions")},
                           prompt_tokens_total=self.prompt_tokens_total,
                           generation_tokens_total=self.generation_tokens_total)
