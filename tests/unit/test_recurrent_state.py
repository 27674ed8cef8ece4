"""Recurrent state as a cache kind: seats through the scheduler (a fake model whose state lives in its seat),
sizing out of the pool's byte budget, the reduction line and the refusal."""
from __future__ import annotations

import random

import pytest
import torch

from tests.kv_harness import expected_outputs, full, make_request, next_token, random_requests
from vllmpy.config import CacheConfig, SchedulerConfig
from vllmpy.engine.kv_cache_spec import KVCacheConfig, KVCacheLayout
from vllmpy.engine.request import RequestStatus
from vllmpy.engine.schedule_types import ModelRunnerOutput, SchedulerOutput
from vllmpy.engine.scheduler import Scheduler
from vllmpy.errors import KVCacheTooSmallError
from vllmpy.layers.recurrent_state import RecurrentMetadata, RecurrentStateSpec
from vllmpy.runner.memory import size_kv_pool

BLOCK = 4
STATE = RecurrentStateSpec(((3, 8), (2, 4, 4)), (torch.float32, torch.float32), "Mamba2")  # 96 + 128 B


class SeatRunner:
    """A fake model that keeps each request's whole context in its seat, as a recurrent layer keeps its
    state: a chunk that continues (start_pos > 0) reads only its seat, so a seat shared by two running
    requests, or one that is not reset for a fresh request, gives wrong tokens."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.seats: dict[int, list[int]] = {}
        self.prompts: dict[str, list[int]] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for new in out.new_requests:
            self.prompts[new.req_id] = new.prompt_token_ids + new.output_token_ids
        seats = [chunk.new_block_ids[self.num_groups] for chunk in out.chunks]
        assert all(len(s) == 1 for s in seats)
        assert len({s[0] for s in seats}) == len(seats), "two chunks of one step share a seat"
        sampled = []
        for chunk, (seat,) in zip(out.chunks, seats):
            state = self.seats[seat] if chunk.start_pos > 0 else []
            assert len(state) == chunk.start_pos, f"{chunk.req_id}: seat {seat} holds another request's state"
            state = self.seats[seat] = state + chunk.token_ids
            sampled.append([next_token(state)] if chunk.sample else [])
        return ModelRunnerOutput(req_ids=[c.req_id for c in out.chunks], sampled_token_ids=sampled,
                                 logprobs=[None] * len(out.chunks))


def hybrid_config(num_blocks: int, num_seats: int, specs=None) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, KVCacheLayout.from_specs(specs or [STATE, full(BLOCK), STATE], 1 << 20),
                         num_seats)


def run(scheduler: Scheduler, runner: SeatRunner, requests, abort_every: int = 0, rng=None) -> dict[str, list[int]]:
    for request in requests:
        scheduler.add_request(request)
    steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        updated = scheduler.update_from_output(out, runner.execute(out))
        done = [r.request_id for r in updated if not r.is_finished and r.num_output_tokens >= r.max_tokens]
        scheduler.finish_requests(done, RequestStatus.FINISHED_LENGTH_CAPPED)
        steps += 1
        if abort_every and steps % abort_every == 0 and scheduler.running:
            scheduler.abort_requests(rng.choice(scheduler.running).request_id)
        assert steps < 5000
    return {r.request_id: r.output_token_ids for r in requests if r.status != RequestStatus.FINISHED_ABORTED}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("attention", [True, False])
def test_seats_through_scheduler_with_preemption_and_abort(seed: int, attention: bool) -> None:
    rng = random.Random(seed)
    specs = [STATE, full(BLOCK), STATE] if attention else [STATE, STATE]
    config = hybrid_config(12 if attention else 0, 3, specs)
    num_groups = len(config.groups)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=7), CacheConfig(
        block_size=BLOCK, enable_prefix_caching=False), config, max_model_len=40)
    requests = random_requests(rng, prefix_len=10, max_suffix=12, max_tokens=12, count=16)
    outputs = run(scheduler, SeatRunner(num_groups), requests, abort_every=9, rng=rng)
    for request in requests:
        if request.request_id in outputs:
            assert outputs[request.request_id] == expected_outputs(request.prompt_token_ids, request.max_tokens)
    if attention:
        assert scheduler.num_preemptions > 0, "the pool was meant to force preemptions"
    assert scheduler.kv.seats.num_free == 3, "a seat leaked"
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_admission_waits_for_a_seat() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                          CacheConfig(block_size=BLOCK, enable_prefix_caching=False), hybrid_config(64, 2), 40)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [1, 2, 3], max_tokens=5))
    out = scheduler.schedule()
    assert [c.req_id for c in out.chunks] == ["r0", "r1"] and len(scheduler.waiting) == 1
    scheduler.abort_requests("r0")
    assert [c.req_id for c in scheduler.schedule().chunks if c.start_pos == 0] == ["r2"]
    assert scheduler.kv.block_ids("r2")[-1] == [0], "the aborted request's seat is handed on"


def test_layout_and_spec_bytes() -> None:
    layout = KVCacheLayout.from_specs([STATE, full(BLOCK), STATE, full(BLOCK)], 64)
    assert STATE.bytes_per_seq == 3 * 8 * 4 + 2 * 4 * 4 * 4
    assert [g.layers for g in layout.groups] == [(1, 3)]
    assert [i for i, _ in layout.recurrent] == [0, 2] and layout.num_layers == 4
    assert layout.state_bytes_per_seq == 2 * STATE.bytes_per_seq
    only = KVCacheLayout.from_specs([STATE] * 3, 64)
    assert only.groups == () and only.block_bytes == 0 and only.blocks_per_request(64, 16) == 0


def test_metadata_rows() -> None:
    meta = RecurrentMetadata.build([5, 2, 7], [0, 9, 3], [4, 1, 1], torch.device("cpu"))
    assert meta.query_start_loc == [0, 4, 5, 6] and meta.query_start_loc_tensor.dtype == torch.int32
    assert meta.has_initial_state.tolist() == [False, True, True]
    assert meta.decode_rows == [1, 2] and meta.prefill_rows == [0]
    assert meta.decode_seats.tolist() == [2, 7] and meta.decode_tokens.tolist() == [4, 5]


def size(max_num_seqs: int, kv_cache_memory: int | None = None, num_blocks: int | None = None, specs=None):
    layout = KVCacheLayout.from_specs(specs or [STATE, full(BLOCK), STATE], 64)
    return layout, size_kv_pool(CacheConfig(block_size=BLOCK, kv_cache_memory=kv_cache_memory, num_blocks=num_blocks),
                                layout, 0, 64, 16, max_num_seqs=max_num_seqs)


def test_seats_come_out_of_the_budget_first() -> None:
    layout, pool = size(4, kv_cache_memory=100_000)
    assert pool.num_seats == 4 and pool.reduction is None
    # then the prefix-cache snapshots: the default --recurrent-snapshot-fraction 0.1 of the pool
    assert pool.num_snapshots == 10_000 // layout.state_bytes_per_seq
    assert pool.num_blocks == (100_000 - (4 + pool.num_snapshots) * layout.state_bytes_per_seq) // layout.block_bytes
    assert "4 recurrent-state seats x 448 B" in pool.info


def test_reduction_line() -> None:
    # One 64-token sequence's KV: 16 blocks x 32 B = 512 B; 1400 B leaves 888 B = 3 pages of 224 B, 2 per seat.
    layout, pool = size(8, kv_cache_memory=1400)
    assert layout.block_bytes == 32 and pool.num_seats == 1
    assert pool.reduction == (
        "recurrent-state budget: reduced max_num_seqs from 8 to 1. The KV pool (43 blocks) holds 3 unified "
        "pages of 28 tokens (one page = one 224-byte Mamba2 state), and each sequence owns 2 of them. Raise "
        "--num-blocks / --kv-cache-memory for more concurrent sequences, or lower num_speculative_tokens.")
    assert pool.num_blocks >= layout.blocks_per_request(64, 16)


def test_refusal_names_the_arithmetic() -> None:
    with pytest.raises(KVCacheTooSmallError) as info:
        size(8, kv_cache_memory=900)
    message = str(info.value)
    assert "512 bytes of KV blocks (16 blocks x 32 B) plus 2 x 224 = 448 bytes of recurrent state" in message
    assert "--kv-cache-memory to at least 960 bytes" in message


def test_no_recurrent_state_is_never_reduced() -> None:
    _, pool = size(64, kv_cache_memory=1100, specs=[full(BLOCK)] * 2)
    assert pool.num_seats == 0 and pool.reduction is None


def test_num_blocks_without_attention_counts_states() -> None:
    _, pool = size(8, num_blocks=5, specs=[STATE, STATE])
    # --num-blocks 5 on a model of recurrent layers only: five sequences' states.
    assert pool.num_blocks == 0 and pool.num_seats == 5 and "reduced max_num_seqs from 8 to 5" in pool.reduction


def test_ssm_cache_dtype_flag() -> None:
    import argparse

    from vllmpy.entrypoints.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--mamba-ssm-cache-dtype", "bfloat16"]))
    assert config.cache.mamba_ssm_cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match="--mamba-ssm-cache-dtype must be one of auto, float32, bfloat16, float16"):
        CacheConfig(mamba_ssm_cache_dtype="fp8").validate()
