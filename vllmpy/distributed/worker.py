"""A worker rank (1..N-1), in a spawned process (mp) or a Ray actor: its part of the model and of the KV
cache, and the forward of every SchedulerOutput the driver hands out. It never schedules or samples: a
tensor-parallel worker's logits are gathered on the driver (layers/parallel.py), a pipeline stage sends
its hidden states to the next stage and the last one its logits to the driver (distributed/pipeline.py),
so it keeps no more per-request state than the forward needs."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from vllmpy.config import EngineConfig
from vllmpy.distributed.cpu_binding import bind_rank
from vllmpy.distributed.parallel_state import RankGroup, destroy_group, init_group
from vllmpy.distributed.pipeline import stage_cache_config
from vllmpy.engine.kv_cache_spec import KVCacheConfig
from vllmpy.loader.model_loader import Checkpoint, build_model, open_checkpoint
from vllmpy.models.base import CausalLM
from vllmpy.runner.model_runner import ModelRunner
from vllmpy.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("vllmpy")


@dataclass(frozen=True)
class WorkerSpec:
    """What the driver resolved before it started the workers, so every rank builds the same model."""

    config: EngineConfig
    world_size: int
    init_method: str  # tcp://HOST:PORT, the driver's rendezvous
    device: str
    dtype: torch.dtype
    task: str
    max_model_len: int
    pipeline: bool = False  # ranks are pipeline stages, else tensor-parallel shards


def build_shard(spec: WorkerSpec, group: RankGroup) -> tuple[CausalLM, Checkpoint]:
    """This rank's part of the model and the checkpoint it came from (for the tokenizer and EOS ids)."""
    checkpoint = open_checkpoint(spec.config.model)
    model = build_model(checkpoint, spec.dtype, group.device, spec.task, spec.max_model_len, group)
    return model, checkpoint


def run_worker(spec: WorkerSpec, rank: int, ready: Connection) -> None:
    """An mp worker's whole life: take its cores, say it is ready (on `ready`), then serve."""
    bind_rank(rank, spec.world_size)
    ready.send(rank)
    ready.close()
    serve(spec, rank)


def serve(spec: WorkerSpec, rank: int) -> None:
    """Join the group, load, take the KV pool from the driver, then run each step the driver hands out until
    it sends None (shutdown). Any exception ends the worker; the driver's next collective then fails and
    stops the engine."""
    group = init_group(rank, spec.world_size, spec.init_method, torch.device(spec.device), spec.pipeline)
    torch.manual_seed(spec.config.model.seed)
    model, checkpoint = build_shard(spec, group)
    kv_cache_config: KVCacheConfig | None = group.broadcast_object()
    if kv_cache_config is None:  # the driver failed to start (KV sizing, its own load) and shut down
        destroy_group(group)
        return
    kv_cache_config = stage_cache_config(kv_cache_config, model)  # a pipeline stage: its layers' pages only
    vocab_size = checkpoint.config["vocab_size"]
    runner = ModelRunner(model, group.device, spec.dtype, kv_cache_config, vocab_size, checkpoint.eos_token_ids,
                         StructuredOutputManager(checkpoint.tokenizer, vocab_size, checkpoint.eos_token_ids,
                                                 spec.config.model.structured_outputs_config))
    logger.info("%s rank %d/%d ready", "pipeline stage" if spec.pipeline else "tensor-parallel", rank,
                spec.world_size)
    next_step = group.recv_step if spec.pipeline else group.broadcast_object
    while (scheduler_output := next_step()) is not None:
        runner.execute(scheduler_output)
    if spec.pipeline:
        group.flush()
    destroy_group(group)
