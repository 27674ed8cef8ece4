"""Scheduler: token budget, chunked prefill, policies, preemption, prefix hits, aborts.

A fake runner (tests/kv_harness.py) keeps a simulated paged KV cache and reads the context back through
the block table: a wrong block table, a shared block overwritten or an evicted block still in use shows
up as a context mismatch.
"""
import random

import pytest

from tests.kv_harness import FakeRunner, expected_outputs, kv_config, make_request, random_requests, step
from vllmpy.config import CacheConfig, SchedulerConfig
from vllmpy.engine.request import RequestStatus
from vllmpy.engine.schedule_types import ModelRunnerOutput
from vllmpy.engine.scheduler import Scheduler

BS = 4


def make_scheduler(num_blocks=64, max_model_len=64, policy="fcfs", max_num_seqs=8, budget=32,
                   caching=True, chunked=True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     scheduling_policy=policy, enable_chunked_prefill=chunked),
                     CacheConfig(block_size=BS, enable_prefix_caching=caching), kv_config(num_blocks, BS),
                     max_model_len)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "lpm"])
def test_randomized_run_respects_budget_seqs_and_outputs(policy):
    rng = random.Random(1234)
    budget, max_seqs, max_model_len = 24, 5, 48
    scheduler = make_scheduler(num_blocks=16, max_model_len=max_model_len, policy=policy,
                               max_num_seqs=max_seqs, budget=budget)
    runner = FakeRunner(BS)
    pending = random_requests(rng, prefix_len=8, max_suffix=30, max_tokens=12)
    all_requests = list(pending)
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop(0))
        if not pending and not scheduler.has_unfinished_requests():
            break
        out, _ = step(scheduler, runner)
        assert out.num_batched_tokens <= budget
        assert len(out.chunks) <= max_seqs and len(scheduler.running) <= max_seqs
        assert len({c.req_id for c in out.chunks}) == len(out.chunks)
        assert all(c.start_pos + len(c.token_ids) <= max_model_len for c in out.chunks)
        assert all(c.token_ids for c in out.chunks)
    else:
        pytest.fail("requests did not finish")

    stats = scheduler.stats()
    assert stats.num_preemptions > 0  # the pool is small enough to force some
    assert stats.prefix_cache_hits > 0
    assert stats.num_running == stats.num_waiting == 0
    assert scheduler.kv.num_free_blocks == 16 and stats.kv_cache_usage == 0
    for request in all_requests:
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        n = min(request.max_tokens, max_model_len - request.num_prompt_tokens)
        assert request.output_token_ids == expected_outputs(request.prompt_token_ids, n)


def test_chunked_prefill_splits_long_prompt_while_decode_continues():
    scheduler = make_scheduler(budget=8, max_model_len=64)
    runner = FakeRunner(BS)
    scheduler.add_request(make_request("short", [1, 2, 3], max_tokens=20))
    out, _ = step(scheduler, runner)
    assert [(c.req_id, len(c.token_ids), c.sample) for c in out.chunks] == [("short", 3, True)]
    scheduler.add_request(make_request("long", list(range(100, 120)), max_tokens=2))
    long_chunks = []
    for _ in range(3):
        out, _ = step(scheduler, runner)
        by_id = {c.req_id: c for c in out.chunks}
        assert len(by_id["short"].token_ids) == 1 and by_id["short"].sample  # decode keeps going
        long_chunks.append(by_id["long"])
    assert [(c.start_pos, len(c.token_ids), c.sample) for c in long_chunks] == [
        (0, 7, False), (7, 7, False), (14, 6, True)]
    assert scheduler.get_request("long").num_output_tokens == 1


def test_config_that_could_stall_is_refused():
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        make_scheduler(budget=8, max_model_len=16, chunked=False)
    with pytest.raises(ValueError, match="3 blocks x 4 tokens"):
        make_scheduler(num_blocks=3, max_model_len=16)


def test_chunked_prefill_off_waits_for_a_whole_prompt():
    scheduler = make_scheduler(budget=16, max_model_len=16, chunked=False)
    runner = FakeRunner(BS)
    scheduler.add_request(make_request("a", [1] * 10, max_tokens=3))
    scheduler.add_request(make_request("b", [2] * 10, max_tokens=3))
    out, _ = step(scheduler, runner)
    assert [c.req_id for c in out.chunks] == ["a"]
    out, _ = step(scheduler, runner)
    assert [(c.req_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("b", 10)]


def test_priority_policy_admits_lowest_value_first_ties_by_arrival():
    scheduler = make_scheduler(policy="priority", max_num_seqs=1)
    runner = FakeRunner(BS)
    for req_id, priority, arrival in [("p3", 3, 0.0), ("p1-late", 1, 2.0), ("p1", 1, 1.0), ("p2", 2, 3.0)]:
        scheduler.add_request(make_request(req_id, [1, 2], max_tokens=1, arrival=arrival, priority=priority))
    order = []
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner)
        order += [n.req_id for n in out.new_requests]
    assert order == ["p1", "p1-late", "p2", "p3"]


def test_lpm_admits_longest_cached_prefix_first():
    shared = list(range(1, 13))  # three full blocks
    orders = {}
    for policy in ("fcfs", "lpm"):
        scheduler, runner = make_scheduler(policy=policy, max_num_seqs=1), FakeRunner(BS)
        scheduler.add_request(make_request("warm", shared + [99], max_tokens=1))
        step(scheduler, runner)
        scheduler.add_request(make_request("none", [40, 41, 42, 43, 44, 45], max_tokens=1, arrival=1.0))
        scheduler.add_request(make_request("one", shared[:4] + [50, 51], max_tokens=1, arrival=2.0))
        scheduler.add_request(make_request("three", shared + [60], max_tokens=1, arrival=3.0))
        orders[policy] = []
        while scheduler.has_unfinished_requests():
            out, _ = step(scheduler, runner)
            orders[policy] += [n.req_id for n in out.new_requests]
    assert orders["fcfs"] == ["none", "one", "three"]
    assert orders["lpm"] == ["three", "one", "none"]


def tight_pair(policy: str, priorities=(0, 0)) -> tuple[Scheduler, FakeRunner]:
    """Two 7-token prompts in a 4-block pool: both fit until the first needs its third block."""
    scheduler = make_scheduler(num_blocks=4, max_model_len=16, policy=policy)
    runner = FakeRunner(BS)
    scheduler.add_request(make_request("a", [1] * 7, max_tokens=5, arrival=0.0, priority=priorities[0]))
    scheduler.add_request(make_request("b", [2] * 7, max_tokens=5, arrival=1.0, priority=priorities[1]))
    step(scheduler, runner)  # both prefill: 2 blocks each
    out, _ = step(scheduler, runner)  # both decode position 7, still in their second block
    assert not out.preempted_req_ids
    return scheduler, runner


def test_fcfs_preempts_latest_arrival_to_the_front_of_the_queue():
    scheduler, runner = tight_pair("fcfs")
    scheduler.add_request(make_request("c", [3] * 7, arrival=2.0))  # no room: stays waiting
    out, _ = step(scheduler, runner)
    assert out.preempted_req_ids == {"b"} and [c.req_id for c in out.chunks] == ["a"]
    b = scheduler.get_request("b")
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.stats().num_preemptions == 1


def test_no_admission_in_a_step_that_preempted():
    scheduler, runner = tight_pair("priority", priorities=(0, 5))
    scheduler.add_request(make_request("c", [3, 3], arrival=2.0, priority=1))  # would fit after it
    out, _ = step(scheduler, runner)
    assert out.preempted_req_ids == {"b"} and [c.req_id for c in out.chunks] == ["a"]
    assert not out.new_requests and scheduler.get_request("c").status == RequestStatus.WAITING
    out, _ = step(scheduler, runner)
    assert [n.req_id for n in out.new_requests] == ["c"]


def test_victim_already_scheduled_this_step_loses_its_chunk_and_budget():
    scheduler = make_scheduler(num_blocks=5, max_model_len=16, policy="priority", budget=4)
    runner = FakeRunner(BS)
    scheduler.add_request(make_request("a", [1] * 3, max_tokens=10, arrival=0.0, priority=5))
    scheduler.add_request(make_request("b", [2] * 3, max_tokens=10, arrival=1.0, priority=0))
    step(scheduler, runner)
    step(scheduler, runner)
    scheduler.add_request(make_request("c", [3] * 9, max_tokens=10, arrival=2.0, priority=1))
    step(scheduler, runner)
    out, _ = step(scheduler, runner)
    assert scheduler.kv.num_free_blocks == 0 and [r.request_id for r in scheduler.running] == ["b", "a", "c"]
    # Running order b, a, c: "a" decodes without a new block, then c's prefill chunk needs one and the
    # victim is "a" (priority 5): its chunk is withdrawn and its token goes back to c.
    out, _ = step(scheduler, runner)
    assert out.preempted_req_ids == {"a"}
    assert [(c.req_id, c.start_pos, len(c.token_ids)) for c in out.chunks] == [("b", 6, 1), ("c", 4, 3)]


def test_max_num_seqs_caps_admission():
    scheduler = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", [i + 1] * 3))
    out, _ = step(scheduler, FakeRunner(BS))
    assert [c.req_id for c in out.chunks] == ["r0", "r1"] and len(scheduler.waiting) == 3


def test_priority_preempts_largest_priority_value_even_if_it_is_the_requester():
    scheduler, runner = tight_pair("priority", priorities=(5, 0))
    out, _ = step(scheduler, runner)
    # "a" asks first for a block, is itself the lowest priority, so it stops; "b" proceeds.
    assert out.preempted_req_ids == {"a"} and [c.req_id for c in out.chunks] == ["b"]
    assert scheduler.get_request("a").status == RequestStatus.PREEMPTED


def test_preempted_request_resumes_with_its_outputs():
    scheduler, runner = tight_pair("fcfs")
    b = scheduler.get_request("b")
    step(scheduler, runner)  # b preempted
    outputs_before = list(b.output_token_ids)
    assert len(outputs_before) == 2
    resumed = None
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner)
        for new in out.new_requests:
            resumed = (new, next(c for c in out.chunks if c.req_id == "b"))
    new, chunk = resumed
    assert new.req_id == "b" and new.output_token_ids == outputs_before
    assert chunk.start_pos + len(chunk.token_ids) == 9 and chunk.sample  # prompt + outputs recomputed
    assert b.output_token_ids == expected_outputs([2] * 7, 5) and b.num_preemptions == 1


def test_prefix_hit_skips_prefill_and_counts():
    scheduler = make_scheduler()
    runner = FakeRunner(BS)
    prompt = list(range(1, 11))
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    step(scheduler, runner)
    scheduler.add_request(make_request("b", prompt, max_tokens=1))
    out, _ = step(scheduler, runner)
    (chunk,) = out.chunks
    assert (chunk.start_pos, chunk.token_ids) == (8, [9, 10])
    assert scheduler.get_request("b") is None  # finished; the runner verified the shared KV
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(0.4)


def test_abort_frees_blocks_and_reports_ids():
    scheduler = make_scheduler(num_blocks=32)
    runner = FakeRunner(BS)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", list(range(i * 20, i * 20 + 9)), max_tokens=10))
    step(scheduler, runner)
    step(scheduler, runner)
    assert scheduler.stats().kv_cache_usage > 0
    scheduler.abort_requests(["r0", "r1", "r2", "r3", "unknown"])
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv.num_free_blocks == 32 and scheduler.stats().kv_cache_usage == 0
    out = scheduler.schedule()
    assert out.is_empty and out.finished_req_ids == {"r0", "r1", "r2", "r3"}
    assert scheduler.schedule().finished_req_ids == set()


def test_runner_error_finishes_only_that_request():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("ok", [1, 2, 3]))
    scheduler.add_request(make_request("bad", [4, 5, 6]))
    out = scheduler.schedule()
    runner_out = ModelRunnerOutput(req_ids=["ok", "bad"], sampled_token_ids=[[7], []],
                                   logprobs=[None, None], errors={"bad": "boom"})
    updated = {r.request_id: r for r in scheduler.update_from_output(out, runner_out)}
    assert updated["bad"].status == RequestStatus.FINISHED_ERROR and updated["bad"].error == "boom"
    assert updated["ok"].output_token_ids == [7] and updated["ok"].status == RequestStatus.RUNNING
    assert scheduler.schedule().finished_req_ids == {"bad"}


def test_max_model_len_refuses_long_prompt_and_caps_generation():
    scheduler = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="8 tokens.*max_model_len is 8"):
        scheduler.add_request(make_request("long", list(range(8))))
    runner = FakeRunner(BS)
    request = make_request("r", [1, 2, 3, 4, 5], max_tokens=100)
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner)
        assert all(c.start_pos + len(c.token_ids) <= 8 for c in out.chunks)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and request.num_tokens == 8
