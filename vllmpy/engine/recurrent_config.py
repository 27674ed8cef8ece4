"""What recurrent layers change in the engine's configuration: the SSM state dtype and the seat-bounded
max_num_seqs. (Prefix caching stays on: hits resume from state snapshots, engine/recurrent_snapshots.py.)"""
from __future__ import annotations

import dataclasses
import logging

import torch

from vllmpy.config import EngineConfig
from vllmpy.engine.kv_cache_spec import KVCacheLayout
from vllmpy.runner.memory import PoolSize

logger = logging.getLogger("vllmpy")

SSM_DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def ssm_cache_dtype(name: str) -> torch.dtype:
    """--mamba-ssm-cache-dtype as a torch dtype (auto = float32, as the state accumulates every token)."""
    return SSM_DTYPES[name]


def fit_to_pool(config: EngineConfig, layout: KVCacheLayout, size: PoolSize) -> EngineConfig:
    """The config the scheduler runs with: max_num_seqs bounded by the seats (the reduction printed).
    Unchanged without recurrent layers."""
    if not layout.recurrent:
        return config
    if size.reduction is not None:
        logger.info(size.reduction)
    scheduler = dataclasses.replace(config.scheduler, max_num_seqs=min(config.scheduler.max_num_seqs, size.num_seats))
    return dataclasses.replace(config, scheduler=scheduler)
