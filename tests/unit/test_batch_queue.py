"""Pipeline parallel's batch queue (engine/batch_queue.py) on the scheduler and the fake runner of
tests/kv_harness.py: up to PP micro-batches in flight hold disjoint requests, a request in flight is
neither preempted nor reported finished to the runner before its batch is back, and every request still
gets exactly its expected tokens under random arrivals, aborts and a pool small enough to preempt."""
from __future__ import annotations

import random

from tests.kv_harness import FakeRunner, expected_outputs, kv_config, make_request, random_requests
from vllmpy.config import CacheConfig, SchedulerConfig
from vllmpy.engine.batch_queue import BatchQueue
from vllmpy.engine.request import RequestStatus
from vllmpy.engine.schedule_types import ModelRunnerOutput, SchedulerOutput
from vllmpy.engine.scheduler import Scheduler

BS = 4


class FakePipeline:
    """Runs each batch at submit (stages see batches in submission order) and hands its output back at
    complete, checking what a pipeline relies on."""

    def __init__(self) -> None:
        self.runner = FakeRunner(BS)
        self.outstanding: list[tuple[set[str], set[str]]] = []  # per batch in flight: its ids, ids dropped since
        self.max_in_flight = 0

    def submit(self, so: SchedulerOutput) -> ModelRunnerOutput:
        ids = {chunk.req_id for chunk in so.chunks}
        dropped = so.finished_req_ids | so.preempted_req_ids
        for other, dropped_since in self.outstanding:
            assert not ids & other, "a request is in two micro-batches"
            dropped_since |= dropped
        self.outstanding.append((ids, set()))
        self.max_in_flight = max(self.max_in_flight, len(self.outstanding))
        return self.runner.execute(so)

    def complete(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        ids, dropped_since = self.outstanding.pop(0)
        assert not ids & dropped_since, "the runner forgot a request whose batch was still in flight"
        return out


def _engine(num_blocks: int, max_num_seqs: int = 8) -> tuple[Scheduler, FakePipeline, BatchQueue]:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=24),
                          CacheConfig(block_size=BS, enable_prefix_caching=True), kv_config(num_blocks, BS), 48)
    pipeline = FakePipeline()
    return scheduler, pipeline, BatchQueue(scheduler, pipeline, 2)


def _step(scheduler: Scheduler, queue: BatchQueue) -> None:
    """One engine step with the engine's max_tokens stop check."""
    updated, _, _ = queue.step()
    done = [r.request_id for r in updated if not r.is_finished and r.num_output_tokens >= r.max_tokens]
    scheduler.finish_requests(done, RequestStatus.FINISHED_LENGTH_CAPPED)


def test_randomized_pipelined_run_gives_every_request_its_tokens():
    rng = random.Random(7)
    scheduler, pipeline, queue = _engine(num_blocks=16)
    pending = random_requests(rng, prefix_len=8, max_suffix=30, max_tokens=12)
    requests, aborted = list(pending), set()
    for _ in range(4000):
        if pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop(0))
        if scheduler.running and rng.random() < 0.03:  # a client goes away, maybe mid-flight
            victim = rng.choice(scheduler.running).request_id
            aborted.add(victim)
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        if not pending and not scheduler.has_unfinished_requests() and not queue.busy:
            break
        _step(scheduler, queue)
    else:
        raise AssertionError("requests did not finish")
    assert pipeline.max_in_flight == 2 and scheduler.num_preemptions > 0
    assert scheduler.in_flight == set() and scheduler.kv.num_free_blocks == 16
    for request in requests:
        if request.request_id in aborted:
            continue
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        n = min(request.max_tokens, 48 - request.num_prompt_tokens)
        assert request.output_token_ids == expected_outputs(request.prompt_token_ids, n)


def test_requests_are_spread_over_the_free_micro_batches():
    scheduler, pipeline, queue = _engine(num_blocks=64)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", [i + 1] * 3, max_tokens=8))
    _, out, first = queue.step()  # submitted, nothing back yet
    assert out is None and [c.req_id for c in first.chunks] == ["r0", "r1"]
    updated, out, done = queue.step()  # the other two fill the second slot; the first batch comes back
    assert done is first and scheduler.in_flight == {"r2", "r3"}
    assert {r.request_id for r in updated} == {"r0", "r1"}


def test_abort_in_flight_is_reported_after_its_batch_returns():
    scheduler, pipeline, queue = _engine(num_blocks=64)
    for i in range(2):
        scheduler.add_request(make_request(f"r{i}", [i + 1] * 3, max_tokens=8))
    queue.step()  # r0 in flight
    scheduler.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    _, _, second = queue.step()  # submits r1's batch, then waits for r0's
    assert "r0" not in second.finished_req_ids and scheduler.in_flight == {"r1"}
    assert "r0" in scheduler.schedule().finished_req_ids  # reported once r0's batch is back
