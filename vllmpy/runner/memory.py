"""KV pool sizing: --num-blocks, --kv-cache-memory or automatic, with a pre-flight refusal.

Pure arithmetic except `available_memory_bytes`. A pool block is one page in each of the layout's
shared tensors (kv_cache_spec.py), so the pool's bytes are num_blocks * layout.block_bytes. A sequence
needs blocks in every KV cache group (a sliding-window group only its window's). --num-blocks N keeps
its per-layer meaning: every layer can hold N blocks at once, so the pool has N blocks per group (one
group: N, as before).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import TYPE_CHECKING

from vllmpy.config import CacheConfig
from vllmpy.engine.kv_cache_spec import KVCacheLayout
from vllmpy.engine.recurrent_snapshots import SNAPSHOT_SPAN
from vllmpy.errors import KVCacheTooSmallError

if TYPE_CHECKING:
    import torch

# Automatic sizing takes this fraction of the memory free after the weights are loaded; the rest is
# headroom for activations, logits and allocator slack (vLLM's default gpu_memory_utilization).
AUTO_KV_FRACTION = 0.9
# On the CPU the pool shares RAM with everything else; like vLLM's CPU backend (4 GiB KV space by
# default) automatic sizing stops there. --kv-cache-memory / --num-blocks go beyond it.
CPU_AUTO_KV_CAP = 4 * 2**30


@dataclass(frozen=True)
class PoolSize:
    num_blocks: int
    num_seats: int  # recurrent-state seats; 0 for a model without recurrent layers
    info: str  # the KV cache INFO line
    reduction: str | None = None  # the recurrent-state budget line, when max_num_seqs was reduced
    num_snapshots: int = 0  # recurrent-state prefix-cache snapshot slots (engine/recurrent_snapshots.py)


def resolve_num_blocks(cache_config: CacheConfig, layout: KVCacheLayout, available_bytes: int,
                       max_model_len: int, max_chunk: int,
                       max_num_seqs: int | None = None, cap_bytes: int | None = None) -> tuple[int, str]:
    """(num_blocks, the INFO line) of size_kv_pool, for a model without recurrent layers."""
    size = size_kv_pool(cache_config, layout, available_bytes, max_model_len, max_chunk, max_num_seqs, cap_bytes)
    return size.num_blocks, size.info


def size_kv_pool(cache_config: CacheConfig, layout: KVCacheLayout, available_bytes: int,
                 max_model_len: int, max_chunk: int,
                 max_num_seqs: int | None = None, cap_bytes: int | None = None) -> PoolSize:
    """Size the pool's blocks (and seats). Raises KVCacheTooSmallError before allocating.

    Precedence: --num-blocks, then --kv-cache-memory (whole-pool byte budget, never exceeded), then
    automatic: AUTO_KV_FRACTION of `available_bytes` (at most `cap_bytes`), capped at `max_num_seqs`
    full-length sequences when given, since blocks beyond that only keep old prefixes alive and would
    pin memory for nothing. `max_chunk` is the most tokens one step computes for a request
    (--max-num-batched-tokens): a sliding window holds its window plus that chunk.

    With recurrent layers the seats come out of the same bytes first (recurrent_seats), then the blocks.
    """
    block_size, bytes_per_block = layout.block_size, layout.block_bytes
    blocks_per_seq = layout.blocks_per_request(max_model_len, max_chunk)
    num_groups = len(layout.groups)
    state_bytes = layout.state_bytes_per_seq
    if cache_config.num_blocks is not None:
        # Without attention layers a block is one sequence's state (vLLM's Mamba-only pool).
        pool_bytes = cache_config.num_blocks * (num_groups * bytes_per_block or state_bytes)
        source = "--num-blocks"
        if num_groups > 1:
            source += f" {cache_config.num_blocks} per layer x {num_groups} groups"
        budget = f"--num-blocks {cache_config.num_blocks}"
    elif cache_config.kv_cache_memory is not None:
        pool_bytes = cache_config.kv_cache_memory
        source = f"--kv-cache-memory {cache_config.kv_cache_memory} B"
        budget = f"budget {cache_config.kv_cache_memory} B (--kv-cache-memory)"
    else:
        pool_bytes = int(available_bytes * AUTO_KV_FRACTION)
        source = f"auto: {AUTO_KV_FRACTION:.0%} of {_gib(available_bytes)} available"
        budget = f"budget {pool_bytes} B = {AUTO_KV_FRACTION:.0%} of {available_bytes} B available"
        if cap_bytes is not None and pool_bytes > cap_bytes:
            pool_bytes = cap_bytes
            source += f", capped at {_gib(cap_bytes)}"
            budget += f", capped at {cap_bytes} B"
        seq_bytes = blocks_per_seq * bytes_per_block + state_bytes
        if max_num_seqs is not None and pool_bytes > max_num_seqs * seq_bytes:
            pool_bytes = max_num_seqs * seq_bytes
            source += f", capped at {max_num_seqs} sequences of {max_model_len} tokens"

    num_seats, reduction = 0, None
    if layout.recurrent:
        num_seats, reduction = recurrent_seats(layout, pool_bytes, blocks_per_seq, max_model_len,
                                               max_num_seqs, budget)
    num_snapshots = snapshot_slots(cache_config, layout, pool_bytes, pool_bytes - num_seats * state_bytes,
                                   blocks_per_seq)
    num_blocks = (pool_bytes - (num_seats + num_snapshots) * state_bytes) // bytes_per_block if bytes_per_block else 0
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
    block_pool_bytes = num_blocks * bytes_per_block
    info = (f"KV cache: {num_blocks} blocks x {block_size} tokens = {num_tokens} tokens, "
            f"{block_pool_bytes} bytes ({_gib(block_pool_bytes)}, {bytes_per_block} B/block) [{source}]; {groups}; "
            + (f"fits {num_blocks // blocks_per_seq} sequences of {max_model_len} tokens" if blocks_per_seq else
               "no blocks needed"))
    if num_seats:
        info += f"; {num_seats} recurrent-state seats x {state_bytes} B = {num_seats * state_bytes} bytes"
    if layout.recurrent and cache_config.enable_prefix_caching:
        info += (f"; {num_snapshots} prefix-cache snapshots of that state (one per {SNAPSHOT_SPAN} prompt tokens, "
                 f"--recurrent-snapshot-fraction {cache_config.recurrent_snapshot_fraction:g} of the pool) = "
                 f"{num_snapshots * state_bytes} bytes")
    return PoolSize(num_blocks, num_seats, info, reduction, num_snapshots)


def snapshot_slots(cache_config: CacheConfig, layout: KVCacheLayout, pool_bytes: int, spare_bytes: int,
                   blocks_per_seq: int) -> int:
    """Snapshot slots for prefix caching on recurrent layers: --recurrent-snapshot-fraction of the pool,
    out of the `spare_bytes` the seats leave, never leaving less than one max_model_len sequence's blocks."""
    if not layout.recurrent or not cache_config.enable_prefix_caching:
        return 0
    room = spare_bytes - blocks_per_seq * layout.block_bytes
    return max(0, min(int(pool_bytes * cache_config.recurrent_snapshot_fraction), room)) // layout.state_bytes_per_seq


def size_kv_pools(cache_config: CacheConfig, layout: KVCacheLayout, draft: KVCacheLayout | None,
                  available_bytes: int, max_model_len: int, max_chunk: int, max_num_seqs: int | None = None,
                  cap_bytes: int | None = None) -> tuple[PoolSize, PoolSize | None]:
    """size_kv_pool for the target and, with a draft model (speculative decoding), for the draft's own
    cache out of the same budget: the byte budget (--kv-cache-memory, or automatic with its caps) is split
    in proportion to the bytes one full-length sequence needs in each, so both pools hold as many tokens;
    --num-blocks N gives each pool N blocks per group (its per-layer meaning)."""
    if draft is None:
        return size_kv_pool(cache_config, layout, available_bytes, max_model_len, max_chunk, max_num_seqs,
                            cap_bytes), None
    if cache_config.num_blocks is not None:
        target = own = Fraction(1)
    else:  # exact shares: the two pools' bytes never exceed the budget, equal layouts get equal blocks
        need = [lay.blocks_per_request(max_model_len, max_chunk) * lay.block_bytes + lay.state_bytes_per_seq
                for lay in (layout, draft)]
        target = Fraction(need[0], sum(need))
        own = 1 - target

    def share(part: KVCacheLayout, fraction: Fraction, name: str) -> PoolSize:
        memory = cache_config.kv_cache_memory
        cache = cache_config if memory is None else replace(cache_config, kv_cache_memory=int(memory * fraction))
        try:
            return size_kv_pool(cache, part, int(available_bytes * fraction), max_model_len, max_chunk, max_num_seqs,
                                None if cap_bytes is None else int(cap_bytes * fraction))
        except KVCacheTooSmallError as exc:
            raise KVCacheTooSmallError(f"the {name}'s share ({float(fraction):.0%}) of the KV budget the target and "
                                       f"the draft model split: {exc}") from None

    sizes = share(layout, target, "target"), share(draft, own, "draft model")
    if cache_config.num_blocks is None:
        split = f"; {float(target):.0%} of the budget (the draft model's KV cache has the rest)"
        sizes = replace(sizes[0], info=sizes[0].info + split), sizes[1]
    return sizes[0], replace(sizes[1], info="draft model " + sizes[1].info)


def recurrent_seats(layout: KVCacheLayout, pool_bytes: int, blocks_per_seq: int, max_model_len: int,
                    max_num_seqs: int | None, budget: str) -> tuple[int, str | None]:
    """(seats, the reduction line or None): the recurrent states the pool holds next to the KV blocks of
    one max_model_len sequence, at most max_num_seqs. Counted in unified pages of one layer's state (the
    largest), each sequence owning one page per recurrent layer (USAGE's recurrent-state budget line)."""
    page = max(spec.bytes_per_seq for _, spec in layout.recurrent)
    per_seq = len(layout.recurrent)
    one_seq_kv = blocks_per_seq * layout.block_bytes
    pages = max(0, pool_bytes - one_seq_kv) // page
    seats = pages // per_seq if max_num_seqs is None else min(max_num_seqs, pages // per_seq)
    if seats < 1:
        raise KVCacheTooSmallError(
            f"KV cache too small for one recurrent state: the pool has {pool_bytes} bytes ({budget}); one "
            f"sequence of max_model_len {max_model_len} needs {one_seq_kv} bytes of KV blocks ({blocks_per_seq} "
            f"blocks x {layout.block_bytes} B) plus {per_seq} x {page} = {per_seq * page} bytes of recurrent "
            f"state. Raise --kv-cache-memory to at least {one_seq_kv + per_seq * page} bytes, raise "
            f"--num-blocks, or lower --max-model-len.")
    if max_num_seqs is None or seats == max_num_seqs:
        return seats, None
    # A page's bytes as attention tokens (one layer's K/V); without attention a state serves any length.
    tokens = page * layout.block_size // layout.page_bytes if layout.groups else max_model_len
    pool_blocks = pool_bytes // (layout.block_bytes or page)
    return seats, (f"recurrent-state budget: reduced max_num_seqs from {max_num_seqs} to {seats}. The KV pool "
                   f"({pool_blocks} blocks) holds {pages} unified pages of {tokens} tokens (one page = one "
                   f"{page}-byte {layout.recurrent[0][1].label} state), and each sequence owns {per_seq} of "
                   f"them. Raise --num-blocks / --kv-cache-memory for more concurrent sequences, or lower "
                   f"num_speculative_tokens.")


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
