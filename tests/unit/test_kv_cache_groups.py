"""KV cache groups: full-attention and sliding-window layers over one pool (block accounting per group,
blocks freed outside the window, prefix hits per group, every block back after preemption and abort).

The model here has layers [sliding, full, sliding]: three groups of one layer, window 6 over 4-token
blocks, so a window spans two to three blocks and a sliding hit needs the last two blocks cached.
"""
import random

import pytest

from tests.kv_harness import (FakeRunner, expected_outputs, full, kv_config, make_request, random_requests, sliding,
                              step)
from vllmpy.config import CacheConfig, SchedulerConfig
from vllmpy.engine.kv_cache import block_key, extend_chain_hashes
from vllmpy.engine.kv_cache_coordinator import KVCacheCoordinator
from vllmpy.engine.kv_cache_managers import SlidingWindowManager
from vllmpy.engine.kv_cache_spec import KVCacheLayout, SlidingWindowSpec
from vllmpy.engine.request import RequestStatus
from vllmpy.engine.scheduler import Scheduler

BS, WINDOW = 4, 6
SPECS = [sliding(BS, WINDOW), full(BS), sliding(BS, WINDOW)]


def windows(kv: KVCacheCoordinator) -> tuple:
    return tuple(m.window if isinstance(m, SlidingWindowManager) else None for m in kv.managers)


def make_scheduler(num_blocks=64, max_model_len=64, policy="fcfs", max_num_seqs=8, budget=32,
                   caching=True) -> tuple[Scheduler, FakeRunner]:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                          scheduling_policy=policy),
                          CacheConfig(block_size=BS, enable_prefix_caching=caching),
                          kv_config(num_blocks, BS, SPECS, max_model_len), max_model_len)
    return scheduler, FakeRunner(BS, windows(scheduler.kv))


def held(kv: KVCacheCoordinator) -> int:
    """Distinct blocks in every table (shared prefix blocks once, placeholders not at all)."""
    return len({block.block_id for m in kv.managers for table in m.tables.values() for block in table
                if block is not None})


def test_layout_groups_equal_specs_into_equal_sized_groups():
    layout = KVCacheLayout.from_specs(SPECS * 2, max_model_len=64)  # 4 sliding, 2 full layers
    assert [(type(g.spec).__name__, g.layers) for g in layout.groups] == [
        ("SlidingWindowSpec", (0, 2)), ("SlidingWindowSpec", (3, 5)), ("FullAttentionSpec", (1, 4))]
    assert layout.layers_per_group == 2 and layout.block_bytes == 2 * SPECS[0].page_bytes
    # Blocks a lone 64-token request can hold, with 32-token chunks: 16 full, ceil((5 + 32) / 4) + 1 per window.
    assert layout.blocks_per_request(64, 32) == 16 + 2 * 11


def test_decoding_returns_blocks_outside_the_window_and_accounts_per_group():
    scheduler, runner = make_scheduler(num_blocks=40, budget=8)
    kv = scheduler.kv
    scheduler.add_request(make_request("a", list(range(1, 11)), max_tokens=30))
    seen_placeholder = False
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner)
        assert kv.num_free_blocks == kv.num_blocks - held(kv)  # nothing leaked or counted twice
        request = scheduler.get_request("a")
        if request is None:
            break
        computed = request.num_computed_tokens
        full_table, = [m.tables["a"] for m in kv.managers if not isinstance(m, SlidingWindowManager)]
        assert None not in full_table and len(full_table) * BS >= computed
        for manager in kv.managers:
            if isinstance(manager, SlidingWindowManager):
                table = manager.tables["a"]
                assert len(table) == len(full_table)
                # Only blocks some query of the last step (from its chunk's start) on can see: the rest
                # went back to the pool when the step was scheduled.
                first_visible = max(0, out.chunks[0].start_pos - WINDOW + 1) // BS
                assert all(block is None for block in table[:first_visible])
                assert all(block is not None for block in table[first_visible:])
                seen_placeholder |= None in table
    assert seen_placeholder
    assert kv.num_free_blocks == kv.num_blocks and held(kv) == 0


def test_long_decode_fits_a_pool_smaller_than_its_context_in_every_group():
    # 40 tokens in three groups would take 30 blocks with every block kept; windows keep it far smaller.
    scheduler, runner = make_scheduler(num_blocks=20, max_model_len=48, budget=4)
    request = make_request("a", [7, 8, 9], max_tokens=37)
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert scheduler.num_preemptions == 0 and request.num_tokens == 40
    assert request.output_token_ids == expected_outputs([7, 8, 9], 37)


def cache_positions(kv: KVCacheCoordinator, tokens: list[int], per_group: list[set[int]]) -> None:
    """Publish blocks at the given positions of `tokens` in each group, then leave them free (cached)."""
    hashes = extend_chain_hashes([], tokens, BS, len(tokens) // BS)
    for group, positions in enumerate(per_group):
        for index in sorted(positions):
            (block,) = kv.pool.allocate(1)
            kv.pool.cache_block(block, hashes[index], block_key(hashes, tokens, BS, index), group)
            kv.pool.free([block])


def test_prefix_hit_holds_only_what_each_group_can_see():
    kv = KVCacheCoordinator(kv_config(64, BS, SPECS), enable_caching=True)
    tokens = list(range(100, 125))  # 6 full blocks + 1 token
    sliding_groups = [i for i, w in enumerate(windows(kv)) if w is not None]
    (full_group,) = [i for i, w in enumerate(windows(kv)) if w is None]
    every = set(range(6))

    def hit(per_group: dict[int, set[int]]) -> tuple:
        fresh = KVCacheCoordinator(kv_config(64, BS, SPECS), enable_caching=True)
        cache_positions(fresh, tokens, [per_group.get(g, every) for g in range(3)])
        return fresh.get_computed_blocks(make_request("b", tokens)), fresh

    # Everything cached: full attention reuses all 6 blocks, a window only the last 2 (ceil(5 / 4)).
    (blocks, num_tokens), fresh = hit({})
    assert num_tokens == 24
    assert all(b is not None for b in blocks[full_group]) and len(blocks[full_group]) == 6
    for g in sliding_groups:
        assert [b is not None for b in blocks[g]] == [False] * 4 + [True] * 2
    # The hit takes only its real blocks from the free queue.
    free = fresh.num_free_blocks
    assert fresh.allocate_slots(make_request("b", tokens), 1, blocks)
    assert fresh.num_free_blocks == free - 6 - 2 * 2 - 3  # + one new block per group for the last token
    # A window's blocks missing in one group: the hit falls back to where every group can resume.
    (blocks, num_tokens), _ = hit({sliding_groups[0]: {0, 1, 2, 5}})
    assert num_tokens == 12 and [b is not None for b in blocks[sliding_groups[0]]] == [False, True, True]
    (blocks, num_tokens), _ = hit({sliding_groups[1]: {0, 3}})
    assert num_tokens == 4  # a run from block 0 is a hit even shorter than the window
    # Full attention needs every block from the start.
    (blocks, num_tokens), _ = hit({full_group: {0, 1, 3, 4, 5}})
    assert num_tokens == 8


def test_prefix_hit_through_the_scheduler_counts_and_skips_compute():
    scheduler, runner = make_scheduler()
    prompt = list(range(1, 23))  # 5 full blocks + 2 tokens
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    step(scheduler, runner)
    scheduler.add_request(make_request("b", prompt + [60, 61], max_tokens=2))
    out, _ = step(scheduler, runner)
    (chunk,) = out.chunks
    assert chunk.start_pos == 20  # the runner checked every group's cached window reads back right
    assert scheduler.stats().prefix_cache_hits == 20
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


@pytest.mark.parametrize("policy", ["fcfs", "priority", "lpm"])
def test_randomized_run_with_preemption_and_aborts_returns_every_block(policy):
    rng = random.Random(99)
    budget, max_model_len = 12, 48
    # Smallest pool a lone 48-token request fits in: 12 full blocks + 6 per window (12-token chunks).
    scheduler, runner = make_scheduler(num_blocks=24, max_model_len=max_model_len, policy=policy,
                                       max_num_seqs=5, budget=budget)
    pending = random_requests(rng, prefix_len=12, max_suffix=24, max_tokens=20)
    aborted = set()
    for _ in range(3000):
        if pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop(0))
        if scheduler.running and rng.random() < 0.03:
            victim = rng.choice(scheduler.running).request_id
            scheduler.abort_requests(victim)
            aborted.add(victim)
        if not pending and not scheduler.has_unfinished_requests():
            break
        out, _ = step(scheduler, runner)
        assert out.num_batched_tokens <= budget
        assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks - held(scheduler.kv)
    else:
        pytest.fail("requests did not finish")
    stats = scheduler.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and aborted
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks and stats.kv_cache_usage == 0
    assert all(not m.tables for m in scheduler.kv.managers)


def test_preempted_and_aborted_requests_give_back_every_group_block():
    scheduler, runner = make_scheduler(num_blocks=24, max_model_len=48, budget=12, policy="fcfs")
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [i + 1] * 14, max_tokens=30, arrival=float(i)))
    while scheduler.num_preemptions == 0:
        step(scheduler, runner)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks - held(scheduler.kv)
    preempted = [r for r in scheduler.waiting if r.status == RequestStatus.PREEMPTED]
    assert preempted and all(r.request_id not in m.tables for r in preempted for m in scheduler.kv.managers)
    scheduler.abort_requests([f"r{i}" for i in range(3)])
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_sliding_spec_refuses_an_empty_window():
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        SlidingWindowSpec(BS, 1, 1, SPECS[0].dtype, 0)
