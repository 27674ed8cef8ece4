"""KV pool sizing: --num-blocks, --kv-cache-memory or automatic, with a pre-flight refusal.

Pure arithmetic except `available_memory_bytes`. A pool block is one page in each of the layout's
shared tensors (kv_cache_spec.py), so the pool's bytes are num_blocks * layout.block_bytes. A sequence
needs blocks in every KV cache group (a sliding-window group only its window's). --num-blocks N keeps
its per-layer meaning: every layer can hold N blocks at once, so the pool has N blocks per group (one
group: N, as before).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllmpy.config import CacheConfig
from vllmpy.engine.kv_cache_spec import KVCacheLayout
from vllmpy.errors import KVCacheTooSmallError

if TYPE_CHECKING:
    import torch

# Automatic sizing takes this fraction of the memory free after the weights are loaded; the rest is
# headroom for activations, logits and allocator slack (vLLM's default gpu_memory_utilization).
AUTO_KV_FRACTION = 0.9
# On the CPU the pool shares RAM with everything else; like vLLM's CPU backend (4 GiB KV space by
# default) automatic sizing stops there. --kv-cache-memory / --num-blocks go beyond it.
CPU_AUTO_KV_CAP = 4 * 2**30


def resolve_num_blocks(cache_config: CacheConfig, layout: KVCacheLayout, available_bytes: int,
                       max_model_len: int, max_chunk: int,
                       max_num_seqs: int | None = None, cap_bytes: int | None = None) -> tuple[int, str]:
    """Return (num_blocks, the one INFO line to print). Raises KVCacheTooSmallError before allocating.

    Precedence: --num-blocks, then --kv-cache-memory (whole-pool byte budget, never exceeded), then
    automatic: AUTO_KV_FRACTION of `available_bytes` (at most `cap_bytes`), capped at `max_num_seqs`
    full-length sequences when given, since blocks beyond that only keep old prefixes alive and would
    pin memory for nothing. `max_chunk` is the most tokens one step computes for a request
    (--max-num-batched-tokens): a sliding window holds its window plus that chunk.
    """
    block_size, bytes_per_block = layout.block_size, layout.block_bytes
    blocks_per_seq = layout.blocks_per_request(max_model_len, max_chunk)
    num_groups = len(layout.groups)
    if cache_config.num_blocks is not None:
        num_blocks = cache_config.num_blocks * num_groups
        source = "--num-blocks"
        if num_groups > 1:
            source += f" {cache_config.num_blocks} per layer x {num_groups} groups"
        budget = f"--num-blocks {cache_config.num_blocks}"
    elif cache_config.kv_cache_memory is not None:
        num_blocks = cache_config.kv_cache_memory // bytes_per_block
        source = f"--kv-cache-memory {cache_config.kv_cache_memory} B"
        budget = f"budget {cache_config.kv_cache_memory} B (--kv-cache-memory)"
    else:
        usable = int(available_bytes * AUTO_KV_FRACTION)
        source = f"auto: {AUTO_KV_FRACTION:.0%} of {_gib(available_bytes)} available"
        budget = f"budget {usable} B = {AUTO_KV_FRACTION:.0%} of {available_bytes} B available"
        if cap_bytes is not None and usable > cap_bytes:
            usable = cap_bytes
            source += f", capped at {_gib(cap_bytes)}"
            budget += f", capped at {cap_bytes} B"
        num_blocks = usable // bytes_per_block
        if max_num_seqs is not None and num_blocks > max_num_seqs * blocks_per_seq:
            num_blocks = max_num_seqs * blocks_per_seq
            source += f", capped at {max_num_seqs} sequences of {max_model_len} tokens"

    num_tokens = num_blocks * block_size
    groups = layout.describe(max_model_len, max_chunk)
    if num_blocks < blocks_per_seq:
        fits = layout.longest_fitting_len(num_blocks, max_chunk, max_model_len)
        raise KVCacheTooSmallError(
            f"KV cache too small: {num_blocks} blocks x {block_size} tokens = {num_tokens} tokens, but one "
            f"sequence of max_model_len {max_model_len} needs {blocks_per_seq} blocks ({groups}; "
            f"{bytes_per_block} bytes per block; {budget}). Raise --kv-cache-memory to at least "
            f"{blocks_per_seq * bytes_per_block} bytes, raise --num-blocks to at least "
            f"{-(-blocks_per_seq // num_groups)}, or lower --max-model-len to {fits} or less.")
    pool_bytes = num_blocks * bytes_per_block
    info = (f"KV cache: {num_blocks} blocks x {block_size} tokens = {num_tokens} tokens, "
            f"{pool_bytes} bytes ({_gib(pool_bytes)}, {bytes_per_block} B/block) [{source}]; {groups}; "
            f"fits {num_blocks // blocks_per_seq} sequences of {max_model_len} tokens")
    return num_blocks, info


def available_memory_bytes(device: str | torch.device) -> int:
    """Free memory on the device now: CUDA free bytes, or the host's MemAvailable on CPU."""
    device = str(device)
    if device.startswith("cuda"):
        import torch  # only a CUDA caller pays for (and needs) torch here
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts in kB
    except OSError:
        pass
    try:
        import psutil
        return psutil.virtual_memory().available
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
