"""Tensor parallel over torch.distributed: process group, worker processes and the mp executor."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllmpy.distributed.errors import DistributedEngineError

if TYPE_CHECKING:
    from vllmpy.config import EngineConfig
    from vllmpy.distributed.executor import MultiprocExecutor

__all__ = ["DistributedEngineError", "start_executor"]


def start_executor(config: EngineConfig, checkpoint_config: dict, device: torch.device, dtype: torch.dtype,
                   task: str, max_model_len: int) -> MultiprocExecutor | None:
    """None at --tensor-parallel-size 1 (nothing imported, nothing spawned); else the mp executor, its
    workers already loading, after refusing by name what tensor parallel does not run yet."""
    size = config.parallel.tensor_parallel_size
    if size == 1:
        return None
    if task != "generate":
        raise ValueError(f"--tensor-parallel-size {size}: a {task} (pooling) model is not run under tensor "
                         f"parallel yet; use --tensor-parallel-size 1")
    if config.lora.enable_lora:
        raise ValueError(f"--tensor-parallel-size {size} with --enable-lora: adapters are not sharded yet; "
                         f"use one of the two")
    check_shardable(checkpoint_config, task, size)
    from vllmpy.distributed.executor import MultiprocExecutor
    return MultiprocExecutor(config, device, dtype, task, max_model_len)


def check_shardable(checkpoint_config: dict, task: str, size: int) -> None:
    """Shard a meta-device copy of the model (no memory, no weights): a layer tensor parallel does not
    cover yet is refused by name before any worker starts."""
    from vllmpy.distributed.parallel_state import TPGroup
    from vllmpy.layers.parallel import shard_model
    from vllmpy.models.registry import resolve_model_class

    with torch.device("meta"):
        model = resolve_model_class(checkpoint_config, task)(checkpoint_config)
    shard_model(model, TPGroup(0, size, torch.device("meta")))
