"""EngineCore.step(): schedule → execute → update. Synchronous and testable; no threads here."""
from __future__ import annotations

import dataclasses
import logging

import torch

from vllmpy import profiling
from vllmpy.attention.kv_dtype import announce_kv_cache_dtype, resolve_kv_cache_dtype
from vllmpy.config import EngineConfig
from vllmpy.distributed import DistributedEngineError, start_executor
from vllmpy.distributed.pipeline import stage_cache_config
from vllmpy.engine.batch_queue import BatchQueue
from vllmpy.engine.kv_cache_spec import KVCacheConfig, KVCacheLayout
from vllmpy.engine.recurrent_config import fit_to_pool, ssm_cache_dtype
from vllmpy.engine.request import Request, RequestStatus
from vllmpy.engine.schedule_types import ModelRunnerOutput, SchedulerOutput
from vllmpy.engine.scheduler import Scheduler
from vllmpy.engine.stream_text import needs_engine_text
from vllmpy.layers.pooler import Pooler, classifier_activation, pooler_config, sentence_transformers_max_len
from vllmpy.loader.model_loader import Checkpoint, build_model, open_checkpoint, resolve_device, resolve_dtype
from vllmpy.lora.manager import LoRAManager
from vllmpy.lora.request import LoRARequest
from vllmpy.models.registry import POOLING_TASKS, resolve_model_class, resolve_task
from vllmpy.multimodal.processor import MultiModalProcessor
from vllmpy.multimodal.scheduling import encoder_scheduler_for
from vllmpy.runner.memory import CPU_AUTO_KV_CAP, available_memory_bytes, size_kv_pools
from vllmpy.runner.model_runner import ModelRunner
from vllmpy.sampling.logits_processors import resolve_logits_processors
from vllmpy.spec_decode.draft_checkpoint import load_draft_model
from vllmpy.spec_decode.draft_model import DraftModelProposer
from vllmpy.spec_decode.drafter import build_drafter
from vllmpy.spec_decode.mtp import MTPProposer, check_mtp_target, load_mtp_draft
from vllmpy.structured_output.manager import StructuredOutputManager
from vllmpy.tokenizer import IncrementalDetokenizer

logger = logging.getLogger("vllmpy")


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        torch.manual_seed(config.model.seed)
        self.checkpoint: Checkpoint = open_checkpoint(config.model)
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.task = resolve_task(self.checkpoint.config, config.model.task)  # "generate" | "embed" | "classify"
        self.max_model_len = config.model.max_model_len or self._default_max_model_len()
        self.pooler: Pooler | None = None
        if self.task in POOLING_TASKS:  # read the pooling config before any weight
            model_cls = resolve_model_class(self.checkpoint.config, self.task)
            self.pooler = Pooler(pooler_config(self.checkpoint.path, model_cls.default_pooling_type))
            config = self._whole_prompts(config, model_cls.is_causal)
        self.config = config
        # --tensor-parallel-size > 1: worker processes load the other shards meanwhile (vllmpy/distributed)
        self.executor = start_executor(config, self.checkpoint.config, self.device, self.dtype, self.task,
                                       self.max_model_len)
        mtp = check_mtp_target(config, self.checkpoint)  # MTP speculation: refused here, before any weight loads
        # Models may depend on the serving length (LongRoPE picks its frequencies by it).
        self.model = build_model(self.checkpoint, self.dtype, self.device, self.task, self.max_model_len,
                                 None if self.executor is None else self.executor.group, keep_mtp=mtp)
        if self.task == "classify":  # the model's head turns the pooled state into logits
            self.pooler = Pooler(self.pooler.config, self.model.classify, classifier_activation(self.checkpoint.config))
        self.tokenizer = self.checkpoint.tokenizer
        # False (AsyncLLM): only requests whose stop pass reads text are detokenized here; the caller
        # makes the others' text (engine/stream_text.py)
        self.detokenize_every_request = True
        self.vocab_size = self.checkpoint.config["vocab_size"]
        self.eos_token_ids = self.checkpoint.eos_token_ids
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype, self.checkpoint.path,
                                                     self.checkpoint.config)
        announce_kv_cache_dtype(self.kv_cache_dtype, self.model.attention_layers())
        layout = KVCacheLayout.from_specs(self.model.kv_cache_specs(
            config.cache.block_size, self.kv_cache_dtype.dtype, ssm_cache_dtype(config.cache.mamba_ssm_cache_dtype)),
            self.max_model_len)
        # draft_model speculation: the draft loads now, so the pool budget covers its own KV cache too
        draft = load_mtp_draft(config, self.checkpoint, self.model, self.device, self.dtype, self.max_model_len) \
            if mtp else load_draft_model(config, self.checkpoint, self.device, self.dtype, self.max_model_len)
        size, draft_size = size_kv_pools(
            config.cache, layout, None if draft is None else draft.layout, available_memory_bytes(self.device),
            self.max_model_len, config.scheduler.max_num_batched_tokens, max_num_seqs=config.scheduler.max_num_seqs,
            cap_bytes=CPU_AUTO_KV_CAP if self.device.type == "cpu" else None)
        logger.info(size.info)
        if draft_size is not None:
            logger.info(draft_size.info)
        config = self.config = fit_to_pool(config, layout, size)  # seats bound max_num_seqs
        self.num_blocks = size.num_blocks
        self.kv_cache_config = KVCacheConfig(size.num_blocks, layout, size.num_seats, size.num_snapshots)
        # --enable-lora: every adaptable linear layer gets adapter slots (vllmpy/lora)
        self.lora = LoRAManager(self.model, config.lora, self.device, self.dtype) if config.lora.enable_lora else None
        # a pipeline stage allocates the pages of its own layers only (the scheduler's pool is the whole model's)
        self.runner = ModelRunner(self.model, self.device, self.dtype,
                                  stage_cache_config(self.kv_cache_config, self.model), self.vocab_size, self.eos_token_ids,
                                  StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                          config.model.structured_outputs_config),
                                  resolve_logits_processors(config.model.logits_processors), self.pooler,
                                  lora=self.lora)
        if self.executor is not None:  # the workers size their KV shards by the driver's layout
            self.executor.start(self.runner, self.kv_cache_config)
        proposer = None if draft is None else (MTPProposer if mtp else DraftModelProposer).build(
            draft, draft_size.num_blocks, self.device, self.dtype, config.scheduler.max_num_batched_tokens)
        if mtp:  # the MTP block reads the target's hidden states of every step
            self.runner.hidden_observer = proposer.observe
        drafter = build_drafter(config.model.speculative_config, layout, self.task, proposer)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.kv_cache_config, self.max_model_len, drafter,
                                   max_loras=config.lora.max_loras if self.lora is not None else None,
                                   encoder=encoder_scheduler_for(self.model, config.scheduler))
        pp = config.parallel.pipeline_parallel_size  # > 1: up to pp micro-batches in flight
        self.batch_queue = BatchQueue(self.scheduler, self.executor, pp) if pp > 1 else None
        # Images: None for a text-only model (a prompt with images is then refused naming the model).
        self.mm_processor = MultiModalProcessor.for_model(self.model, self.checkpoint.path, self.tokenizer,
                                                          config.model.limit_mm_per_prompt)
        if profiling.enabled():  # VLLMPY_PROFILE=1: per-step phase times on stderr
            profiling.attach(self)

    def _default_max_model_len(self) -> int:
        """The checkpoint's context; an embedding model's sentence-transformers max_seq_length, as vLLM."""
        length = self.checkpoint.max_model_len
        if self.task in POOLING_TASKS:  # and no more than a learned position table covers
            length = min(length, sentence_transformers_max_len(self.checkpoint.path) or length)
            limit = getattr(resolve_model_class(self.checkpoint.config, self.task), "position_limit", None)
            length = min(length, limit(self.checkpoint.config)) if limit is not None else length
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
        """Validate and queue; a generation gets the model's EOS ids and its detokenizer (the stop pass
        matches stop strings on its text)."""
        prompt_len = request.num_prompt_tokens
        if prompt_len == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        if request.lora_request is not None:
            self.load_lora(request.lora_request)
        if request.is_pooling:
            self._check_pooling(request)
            self.scheduler.add_request(request)
            return
        if self.task in POOLING_TASKS:
            kind, use = (("an embedding", "LLM.embed() or POST /v1/embeddings") if self.task == "embed" else
                         ("a classification", "LLM.classify() / LLM.score() or POST /classify, /score"))
            raise ValueError(f"model {self._arch} is {kind} model (task {self.task}): it does not generate "
                             f"text; use {use}")
        if prompt_len >= self.max_model_len:
            raise ValueError(f"prompt has {prompt_len} tokens but max_model_len is {self.max_model_len}; "
                             f"shorten the prompt or raise --max-model-len")
        self._check_token_ids(request.prompt_token_ids)
        bias = request.sampling_params.logit_bias or {}
        bad = [t for t in bias if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is out of range [0, {self.vocab_size})")
        request.sampling_params.check_logprobs_limit(self.config.model.max_logprobs, self.vocab_size)
        if request.sampling_params.structured_outputs is not None:
            self.runner.structured_output.validate(request.sampling_params.structured_outputs)
        room = self.max_model_len - prompt_len
        request.max_tokens = min(request.max_tokens or room, room)
        request.eos_token_ids = self.eos_token_ids
        if self.detokenize_every_request or needs_engine_text(request.sampling_params):
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                         request.sampling_params.skip_special_tokens)
        self.scheduler.add_request(request)

    @property
    def _arch(self) -> str:
        return (self.checkpoint.config.get("architectures") or ["?"])[0]

    def load_lora(self, lora_request: LoRARequest) -> None:
        """Refuse an adapter when LoRA is off; load and check it now (a refusal names what is wrong)."""
        if self.lora is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r} was given but LoRA is not enabled; start "
                             f"the engine with --enable-lora (LLM(enable_lora=True))")
        self.lora.add_lora(lora_request)

    def _check_pooling(self, request: Request) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"model {self._arch} is a generative model (task generate): it does not serve "
                             f"embeddings, scores or classes; start it with --task embed to pool its hidden states")
        prompt_len = request.num_prompt_tokens
        if prompt_len > self.max_model_len:
            raise ValueError(f"input has {prompt_len} tokens but this model's maximum context length is "
                             f"{self.max_model_len}; shorten it or set truncate_prompt_tokens")
        self._check_token_ids(request.prompt_token_ids)
        self.pooler.check(request.pooling_params, self.checkpoint.config, self.model.config["hidden_size"])

    def _check_token_ids(self, token_ids: list[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {self.vocab_size})")

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(req_ids, status)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do in one process); also run at exit."""
        if self.executor is not None:
            self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or (self.batch_queue is not None and self.batch_queue.busy)

    def step(self) -> tuple[list[Request], ModelRunnerOutput | None, SchedulerOutput]:
        """One engine iteration; returns the requests that changed (new tokens or finished).

        Failures fail the requests they concern, with `error` saying what raised: a forward (or sampler)
        that raises fails every request scheduled in this step; a request's own sampling, grammar or stop
        check (engine/stop.py, run as the scheduler appends the new tokens) fails only that request; the
        others go on. A failed forward is not re-run request by request to find a culprit:
        the step has already advanced each request's computed tokens, runner state and grammar, so a
        re-run needs a rollback the core does not have, and what fails a whole forward (memory, a kernel)
        is the batch's more often than one prompt's. The scheduler's own failures propagate: its block
        accounting can no longer be trusted, so the engine must stop.
        """
        if self.batch_queue is not None:  # pipeline parallel (no pooling models there)
            return self.batch_queue.step()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return [], None, scheduler_output
        try:
            runner_output = (self.runner.execute(scheduler_output) if self.executor is None
                             else self.executor.execute(scheduler_output))
        except DistributedEngineError:  # a rank is gone: no later step can run either
            raise
        except Exception as exc:
            logger.exception("a step of %d requests failed: failing those requests", len(scheduler_output.chunks))
            runner_output = _failed_step(scheduler_output, f"its step's forward raised {type(exc).__name__}: {exc}")
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        if runner_output.pooled:  # a pooled prompt is done
            updated += [self.scheduler.get_request(i) for i in runner_output.pooled]
            self.scheduler.finish_requests(runner_output.pooled, RequestStatus.FINISHED_STOPPED)
        return updated, runner_output, scheduler_output


def _failed_step(scheduler_output: SchedulerOutput, message: str) -> ModelRunnerOutput:
    """What a step that raised returns: nothing sampled, every scheduled request failed with `message`."""
    req_ids = [chunk.req_id for chunk in scheduler_output.chunks]
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids], logprobs=[None] * len(req_ids),
                             errors=dict.fromkeys(req_ids, message))
