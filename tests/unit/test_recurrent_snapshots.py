"""Recurrent-state snapshots for prefix caching: the scans' states at chosen offsets, the slot pool's
rules, and the scheduler's resume / save plan under a fake model whose state is its seat's context
(a resumed seat that does not hold exactly the hit's tokens gives wrong tokens)."""
from __future__ import annotations

import random

import pytest
import torch

from tests.kv_harness import expected_outputs, full, next_token
from tests.unit.test_recurrent_state import STATE, SeatRunner, hybrid_config, run
from vllmpy.config import CacheConfig, SchedulerConfig
from vllmpy.engine.kv_cache_spec import KVCacheConfig
from vllmpy.engine.recurrent_snapshots import SnapshotPool
from vllmpy.engine.schedule_types import ModelRunnerOutput, SchedulerOutput
from vllmpy.engine.scheduler import Scheduler
from vllmpy.layers.gated_delta_net import chunk_gated_delta_rule, l2_normalize
from vllmpy.layers.mamba2 import ssd_chunk_scan

OFFSETS = [1, 8, 9, 17, 37]  # around the scan's chunk boundaries (8 for SSD, 16 for the delta rule)


def test_scans_save_the_state_after_each_offset() -> None:
    torch.manual_seed(0)
    length, heads, head_dim, groups, size = 37, 4, 8, 2, 6
    x, dt, a = torch.randn(length, heads, head_dim), torch.rand(length, heads) * 0.5, -torch.rand(heads)
    b, c, state = torch.randn(length, groups, size), torch.randn(length, groups, size), torch.randn(heads, head_dim, size)
    saved: list[torch.Tensor] = []
    ssd_chunk_scan(x, dt, a, b, c, state, 8, OFFSETS, saved)
    for offset, got in zip(OFFSETS, saved, strict=True):
        _, want = ssd_chunk_scan(x[:offset], dt[:offset], a, b[:offset], c[:offset], state, 8)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    q, k = (l2_normalize(torch.randn(length, heads, 8)) for _ in range(2))
    v, g, beta, s0 = torch.randn(length, heads, 6), -torch.rand(length, heads), torch.rand(length, heads), \
        torch.randn(heads, 8, 6)
    saved = []
    chunk_gated_delta_rule(q, k, v, g, beta, s0, 16, OFFSETS, saved)
    for offset, got in zip(OFFSETS, saved, strict=True):
        _, want = chunk_gated_delta_rule(q[:offset], k[:offset], v[:offset], g[:offset], beta[:offset], s0, 16)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _key(i: int):
    return (bytes(32), (i,), ())


def test_pool_publishes_after_the_step_and_evicts_least_recent() -> None:
    pool = SnapshotPool(2, block_size=16)
    assert pool.blocks_per_snapshot == 4 and pool.boundaries(0, 130) == [4, 8] and pool.boundaries(64, 127) == []
    hashes = [bytes([i]) * 32 for i in range(12)]
    key_of = _key
    assert pool.reserve("a", [4, 8], [hashes[3], hashes[7]], [_key(3), _key(7)]) == [(4, 0), (8, 1)]
    assert pool.find(hashes, 11, key_of) == (0, None), "a reserved snapshot is found before it is written"
    assert pool.reserve("b", [4], [hashes[3]], [_key(3)]) == [], "the same boundary is written twice"
    pool.publish("a", 5)
    assert pool.find(hashes, 11, key_of) == (4, 0) and pool.num_reserved == 1
    pool.release("a")  # left before block 8 was computed: slot 1 is free again, slot 0 stays cached
    assert pool.num_reserved == 0 and pool.num_cached == 1
    assert pool.reserve("c", [8], [hashes[7]], [_key(7)]) == [(8, 1)]
    pool.publish("c", 8)
    assert pool.find(hashes, 11, key_of) == (8, 1) and pool.find(hashes, 7, key_of) == (4, 0)
    assert pool.find(hashes, 11, lambda i: _key(i + 1)) == (0, None), "a hash collision counted as a hit"
    pool.resume(0)  # slot 0 is now the most recent: slot 1 goes first
    other = [bytes([100 + i]) * 32 for i in range(4)]
    assert pool.reserve("d", [4], [other[3]], [_key(3)]) == [(4, 1)]
    assert pool.find(hashes, 11, key_of) == (4, 0)
    pool.reset()
    assert pool.num_cached == 0 and pool.find(hashes, 11, key_of) == (0, None)


class SnapshotSeatRunner(SeatRunner):
    """SeatRunner with snapshot slots: a resumed seat takes its slot's context, and a chunk's snapshots
    store the context at their offsets."""

    def __init__(self, num_groups: int) -> None:
        super().__init__(num_groups)
        self.slots: dict[int, list[int]] = {}
        self.resumed = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled = []
        for chunk in out.chunks:
            (seat,) = chunk.new_block_ids[self.num_groups]
            if chunk.resume_snapshot is not None:
                self.seats[seat] = list(self.slots[chunk.resume_snapshot])
                self.resumed += 1
            state = self.seats[seat] if chunk.start_pos > 0 else []
            assert len(state) == chunk.start_pos, f"{chunk.req_id}: seat {seat} does not hold its prefix"
            for offset, slot in chunk.save_snapshots:
                self.slots[slot] = state + chunk.token_ids[:offset]
            state = self.seats[seat] = state + chunk.token_ids
            sampled.append([next_token(state)] if chunk.sample else [])
        return ModelRunnerOutput(req_ids=[c.req_id for c in out.chunks], sampled_token_ids=sampled,
                                 logprobs=[None] * len(out.chunks))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("attention", [True, False])
def test_hits_resume_snapshots_through_preemption_and_abort(seed: int, attention: bool) -> None:
    from tests.kv_harness import make_request

    rng = random.Random(seed)
    specs = [STATE, full(4), STATE] if attention else [STATE, STATE]
    base = hybrid_config(52 if attention else 0, 3, specs)  # room for one 200-token sequence: preemptions
    config = KVCacheConfig(base.num_blocks, base.layout, base.num_seats, num_snapshots=5)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=50), CacheConfig(block_size=4),
                          config, max_model_len=200)
    prefixes = [[rng.randrange(1, 50) for _ in range(150)] for _ in range(2)]
    requests = [make_request(f"r{i}", rng.choice(prefixes)[:rng.randrange(40, 151)] + [rng.randrange(1, 50)],
                             max_tokens=rng.randrange(1, 8), arrival=float(i)) for i in range(14)]
    runner = SnapshotSeatRunner(len(config.groups))
    outputs = run(scheduler, runner, requests, abort_every=11, rng=rng)
    for request in requests:
        if request.request_id in outputs:
            assert outputs[request.request_id] == expected_outputs(request.prompt_token_ids, request.max_tokens)
    assert runner.resumed == scheduler.stats().recurrent_snapshot_hits > 0
    if attention:
        assert scheduler.num_preemptions > 0, "the pool was meant to force preemptions"
    assert scheduler.kv.seats.num_free == 3 and scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert scheduler.kv.snapshots.num_reserved == 0 and scheduler.kv.snapshots.num_cached <= 5
