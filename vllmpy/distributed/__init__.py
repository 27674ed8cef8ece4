"""Tensor and pipeline parallel over torch.distributed: process groups, workers, the mp and ray executors."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllmpy.distributed.errors import DistributedEngineError

if TYPE_CHECKING:
    from vllmpy.config import EngineConfig
    from vllmpy.distributed.executor import DriverExecutor

__all__ = ["DistributedEngineError", "start_executor"]


def start_executor(config: EngineConfig, checkpoint_config: dict, device: torch.device, dtype: torch.dtype,
                   task: str, max_model_len: int) -> DriverExecutor | None:
    """None for one rank (nothing imported, nothing spawned); else the chosen executor (mp: processes on
    this host, ray: actors on a Ray cluster), its workers already loading, after refusing by name what
    tensor / pipeline parallel does not run yet."""
    parallel = config.parallel
    if parallel.world_size == 1:
        return None
    flag = (f"--pipeline-parallel-size {parallel.pipeline_parallel_size}" if parallel.pipeline_parallel_size > 1
            else f"--tensor-parallel-size {parallel.tensor_parallel_size}")
    if task != "generate":
        raise ValueError(f"{flag}: a {task} (pooling) model is not run over several ranks yet; use one rank")
    if config.lora.enable_lora:
        raise ValueError(f"{flag} with --enable-lora: adapters are not split over ranks yet; use one of the two")
    if parallel.pipeline_parallel_size > 1 and config.model.speculative_config is not None:
        raise ValueError(f"{flag} with --speculative-config: drafts are not verified across pipeline stages yet; "
                         f"use one of the two")
    if parallel.pipeline_parallel_size > 1:
        from vllmpy.distributed.pipeline import check_stageable
        check_stageable(_meta_model(checkpoint_config, task), parallel.pipeline_parallel_size)
    else:
        check_shardable(checkpoint_config, task, parallel.tensor_parallel_size)
    if parallel.distributed_executor_backend == "ray":
        from vllmpy.distributed.ray_executor import RayExecutor
        return RayExecutor(config, device, dtype, task, max_model_len)
    from vllmpy.distributed.executor import MultiprocExecutor
    return MultiprocExecutor(config, device, dtype, task, max_model_len)


def _meta_model(checkpoint_config: dict, task: str) -> torch.nn.Module:
    """The model on the meta device (no memory, no weights), to be split before any worker starts."""
    from vllmpy.models.registry import resolve_model_class

    with torch.device("meta"):
        return resolve_model_class(checkpoint_config, task)(checkpoint_config)


def check_shardable(checkpoint_config: dict, task: str, size: int) -> None:
    """Shard a meta-device copy of the model: a layer tensor parallel does not cover yet is refused by name."""
    from vllmpy.distributed.parallel_state import TPGroup
    from vllmpy.layers.parallel import shard_model

    shard_model(_meta_model(checkpoint_config, task), TPGroup(0, size, torch.device("meta")))
