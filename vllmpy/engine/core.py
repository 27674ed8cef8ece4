"""EngineCore.step(): schedule → execute → update. Synchronous and testable; no threads here."""
from __future__ import annotations

import dataclasses
import logging

import torch

from vllmpy.config import EngineConfig
from vllmpy.engine.request import Request, RequestStatus
from vllmpy.engine.schedule_types import ModelRunnerOutput, SchedulerOutput
from vllmpy.engine.scheduler import Scheduler
from vllmpy.layers.pooler import Pooler, check_dimensions, pooler_config, sentence_transformers_max_len
from vllmpy.loader.model_loader import Checkpoint, build_model, open_checkpoint, resolve_device, resolve_dtype
from vllmpy.models.registry import resolve_model_class, resolve_task
from vllmpy.runner.memory import CPU_AUTO_KV_CAP, available_memory_bytes, kv_bytes_per_block, resolve_num_blocks
from vllmpy.runner.model_runner import ModelRunner
from vllmpy.sampling.logits_processors import resolve_logits_processors
from vllmpy.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("vllmpy")


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        torch.manual_seed(config.model.seed)
        self.checkpoint: Checkpoint = open_checkpoint(config.model)
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.task = resolve_task(self.checkpoint.config, config.model.task)  # "generate" | "embed"
        self.max_model_len = config.model.max_model_len or self._default_max_model_len()
        # Models may depend on the serving length (LongRoPE picks its frequencies by it).
        self.checkpoint.config["max_model_len"] = self.max_model_len
        self.pooler: Pooler | None = None
        if self.task == "embed":  # read the pooling config before any weight
            model_cls = resolve_model_class(self.checkpoint.config, self.task)
            self.pooler = Pooler(pooler_config(self.checkpoint.path, model_cls.default_pooling_type))
            config = self._whole_prompts(config, model_cls.is_causal)
        self.config = config
        self.model = build_model(self.checkpoint, self.dtype, self.device, self.task)
        self.tokenizer = self.checkpoint.tokenizer
        self.vocab_size = self.checkpoint.config["vocab_size"]
        self.eos_token_ids = self.checkpoint.eos_token_ids
        num_layers, kv_heads, head_dim = self.model.kv_cache_shape()
        block_size = config.cache.block_size
        per_block = kv_bytes_per_block(num_layers, kv_heads, head_dim, block_size,
                                       torch.tensor([], dtype=self.dtype).element_size())
        self.num_blocks, info = resolve_num_blocks(
            config.cache, per_block, available_memory_bytes(self.device), self.max_model_len, block_size,
            max_num_seqs=config.scheduler.max_num_seqs,
            cap_bytes=CPU_AUTO_KV_CAP if self.device.type == "cpu" else None)
        logger.info(info)
        self.runner = ModelRunner(self.model, self.device, self.dtype, block_size, self.num_blocks,
                                  self.vocab_size, self.eos_token_ids,
                                  StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids),
                                  resolve_logits_processors(config.model.logits_processors), self.pooler)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_blocks, self.max_model_len)

    def _default_max_model_len(self) -> int:
        """The checkpoint's context; an embedding model's sentence-transformers max_seq_length, as vLLM."""
        length = self.checkpoint.max_model_len
        if self.task == "embed":
            length = min(length, sentence_transformers_max_len(self.checkpoint.path) or length)
        return length

    def _whole_prompts(self, config: EngineConfig, causal: bool) -> EngineConfig:
        """Encoders and CLS/MEAN pooling read every prompt position in one forward: no chunked prefill
        and no prefix cache (vLLM's defaults for them); LAST pooling on a decoder keeps both."""
        if causal and not self.pooler.config.needs_whole_prompt:
            return config
        logger.info("embedding model (%s pooling%s): chunked prefill and prefix caching are off",
                    self.pooler.config.pooling_type, "" if causal else ", bidirectional")
        scheduler = dataclasses.replace(config.scheduler, enable_chunked_prefill=False, max_num_batched_tokens=max(
            config.scheduler.max_num_batched_tokens, self.max_model_len))
        cache = dataclasses.replace(config.cache, enable_prefix_caching=False)
        return dataclasses.replace(config, scheduler=scheduler, cache=cache)

    def add_request(self, request: Request) -> None:
        prompt_len = request.num_prompt_tokens
        if prompt_len == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        if request.pooling_params is not None:
            self._check_pooling(request)
            self.scheduler.add_request(request)
            return
        if self.task == "embed":
            raise ValueError(f"model {self._arch} is an embedding model (task embed): it does not generate "
                             f"text; use LLM.embed() or POST /v1/embeddings")
        if prompt_len >= self.max_model_len:
            raise ValueError(f"prompt has {prompt_len} tokens but max_model_len is {self.max_model_len}; "
                             f"shorten the prompt or raise --max-model-len")
        self._check_token_ids(request.prompt_token_ids)
        bias = request.sampling_params.logit_bias or {}
        bad = [t for t in bias if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is out of range [0, {self.vocab_size})")
        if request.sampling_params.structured_outputs is not None:
            self.runner.structured_output.validate(request.sampling_params.structured_outputs)
        room = self.max_model_len - prompt_len
        request.max_tokens = min(request.max_tokens or room, room)
        self.scheduler.add_request(request)

    @property
    def _arch(self) -> str:
        return (self.checkpoint.config.get("architectures") or ["?"])[0]

    def _check_pooling(self, request: Request) -> None:
        if self.task != "embed":
            raise ValueError(f"model {self._arch} is a generative model (task generate): it does not serve "
                             f"embeddings; start it with --task embed to pool its hidden states")
        prompt_len = request.num_prompt_tokens
        if prompt_len > self.max_model_len:
            raise ValueError(f"input has {prompt_len} tokens but this model's maximum context length is "
                             f"{self.max_model_len}; shorten it or set truncate_prompt_tokens")
        self._check_token_ids(request.prompt_token_ids)
        check_dimensions(request.pooling_params, self.checkpoint.config, self.model.config["hidden_size"])

    def _check_token_ids(self, token_ids: list[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {self.vocab_size})")

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(req_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> tuple[list[Request], ModelRunnerOutput | None, SchedulerOutput]:
        """One engine iteration; returns the requests that changed (new tokens or finished)."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return [], None, scheduler_output
        runner_output = self.runner.execute(scheduler_output)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        if runner_output.pooled:  # a pooled prompt is done
            updated += [self.scheduler.get_request(i) for i in runner_output.pooled]
            self.scheduler.finish_requests(runner_output.pooled, RequestStatus.FINISHED_STOPPED)
        finished: dict[RequestStatus, list[str]] = {}
        for request in updated:
            if request.is_finished:
                continue
            status = self._check_stop(request, request.request_id in runner_output.grammar_terminated)
            if status is not None:
                finished.setdefault(status, []).append(request.request_id)
        for status, ids in finished.items():
            self.scheduler.finish_requests(ids, status)
        return updated, runner_output, scheduler_output

    def _check_stop(self, request: Request, grammar_terminated: bool) -> RequestStatus | None:
        """Token-level stops; stop strings are checked after detokenization, above the core.

        A completed grammar stops the request even before min_tokens: nothing else may follow.
        """
        if not request.output_token_ids:
            return None
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                request.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if grammar_terminated:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

