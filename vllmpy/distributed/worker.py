"""A tensor-parallel worker process (ranks 1..N-1): its shard of the model and of the KV cache, and the
forward of every SchedulerOutput the driver broadcasts. It never schedules or samples: its runner's logits
go to the driver (layers/parallel.py), so it keeps no more per-request state than the forward needs."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from vllmpy.config import EngineConfig
from vllmpy.distributed.cpu_binding import bind_rank
from vllmpy.distributed.parallel_state import TPGroup, destroy_group, init_group
from vllmpy.engine.kv_cache_spec import KVCacheConfig
from vllmpy.loader.model_loader import Checkpoint, build_model, open_checkpoint
from vllmpy.models.base import CausalLM
from vllmpy.runner.model_runner import ModelRunner
from vllmpy.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("vllmpy")


@dataclass(frozen=True)
class WorkerSpec:
    """What the driver resolved before it spawned the workers, so every rank builds the same model."""

    config: EngineConfig
    world_size: int
    init_method: str  # tcp://127.0.0.1:PORT, the driver's rendezvous
    device: str
    dtype: torch.dtype
    task: str
    max_model_len: int


def build_shard(spec: WorkerSpec, group: TPGroup) -> tuple[CausalLM, Checkpoint]:
    """This rank's model shard and the checkpoint it came from (for the tokenizer and EOS ids)."""
    checkpoint = open_checkpoint(spec.config.model)
    model = build_model(checkpoint, spec.dtype, group.device, spec.task, spec.max_model_len, group)
    return model, checkpoint


def run_worker(spec: WorkerSpec, rank: int, ready: Connection) -> None:
    """The worker's whole life: say it is ready (on `ready`), join the group, load, take the KV layout from
    the driver, then run each broadcast step until the driver sends None (shutdown). Any exception ends the
    process; the driver's next collective then fails and stops the engine."""
    bind_rank(rank, spec.world_size)
    ready.send(rank)
    ready.close()
    group = init_group(rank, spec.world_size, spec.init_method, torch.device(spec.device))
    torch.manual_seed(spec.config.model.seed)
    model, checkpoint = build_shard(spec, group)
    kv_cache_config: KVCacheConfig | None = group.broadcast_object()
    if kv_cache_config is None:  # the driver failed to start (KV sizing, its own load) and shut down
        destroy_group()
        return
    vocab_size = checkpoint.config["vocab_size"]
    runner = ModelRunner(model, group.device, spec.dtype, kv_cache_config, vocab_size, checkpoint.eos_token_ids,
                         StructuredOutputManager(checkpoint.tokenizer, vocab_size, checkpoint.eos_token_ids,
                                                 spec.config.model.structured_outputs_config))
    logger.info("tensor-parallel rank %d/%d ready", rank, spec.world_size)
    while (scheduler_output := group.broadcast_object()) is not None:
        runner.execute(scheduler_output)
    destroy_group()
