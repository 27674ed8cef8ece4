"""Block-table deltas: the scheduler sends each chunk only the blocks appended since the request's last
chunk (its whole table on a first schedule and after resuming from preemption); the FakeRunner rebuilds
the tables from them as the runner's BlockTables does (tests/unit/test_runner_state.py) and reads every
token back through them."""
from __future__ import annotations

from tests.kv_harness import FakeRunner, full, kv_config, make_request, sliding, step
from vllmpy.config import CacheConfig, SchedulerConfig
from vllmpy.engine.scheduler import Scheduler

BS = 4


def test_a_long_decode_sends_one_block_id_per_group_at_most_per_step():
    """500 decode steps after a 64-token prompt, on a full and a sliding-window group: every step's chunk
    carries at most one new block id per group (the whole table would be up to 141 ids), and the
    tables the runner rebuilds from them read every token back (FakeRunner)."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), CacheConfig(block_size=BS),
                          kv_config(400, BS, [full(BS), sliding(BS, 8)], max_model_len=1024), 1024)
    runner = FakeRunner(BS, (None, 8))
    scheduler.add_request(make_request("a", list(range(1, 65)), max_tokens=500))
    first, _ = step(scheduler, runner)
    assert [len(ids) for ids in first.chunks[0].new_block_ids] == [16, 16]  # the whole table, once
    steps = 0
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner)
        assert all(len(ids) <= 1 for ids in out.chunks[0].new_block_ids), out.chunks[0].new_block_ids
        steps += 1
    assert steps == 499 and len(runner.tables) == 1
    assert [len(table) for table in next(iter(runner.tables.values()))] == [141, 141]  # 563 tokens' blocks


def test_a_resumed_request_gets_its_whole_table_again():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), CacheConfig(block_size=BS),
                          kv_config(64, BS), 256)
    runner = FakeRunner(BS)
    request = make_request("a", list(range(1, 30)), max_tokens=20)
    scheduler.add_request(request)
    step(scheduler, runner)
    step(scheduler, runner)
    scheduler._preempt(request)
    out, _ = step(scheduler, runner)
    assert out.new_requests[0].req_id == "a"
    assert len(out.chunks[0].new_block_ids[0]) == 8  # 30 tokens + the next: the whole table
