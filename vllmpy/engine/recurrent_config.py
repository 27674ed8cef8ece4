"""What recurrent layers change in the engine's configuration: the SSM state dtype, the seat-bounded
max_num_seqs, and prefix caching (off until state snapshots land: a cached prefix of KV blocks says
nothing about the recurrent state after it)."""
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


def fit_to_pool(config: EngineConfig, layout: KVCacheLayout, size: PoolSize, arch: str) -> EngineConfig:
    """The config the scheduler runs with: max_num_seqs bounded by the seats (the reduction printed),
    prefix caching off for a model with recurrent layers (said once). Unchanged without them."""
    if not layout.recurrent:
        return config
    if size.reduction is not None:
        logger.info(size.reduction)
    scheduler = dataclasses.replace(config.scheduler, max_num_seqs=min(config.scheduler.max_num_seqs, size.num_seats))
    cache = config.cache
    if cache.enable_prefix_caching:
        logger.info("prefix caching is off for %s: its %d %s layer(s) keep a recurrent state that a cached "
                    "prefix cannot restore yet (state snapshots are not implemented)", arch, len(layout.recurrent),
                    layout.recurrent[0][1].label)
        cache = dataclasses.replace(cache, enable_prefix_caching=False)
    return dataclasses.replace(config, scheduler=scheduler, cache=cache)
