"""Pipeline parallel's engine step: up to PP micro-batches in flight, so the stages overlap (vLLM's batch
queue). A step submits a new batch while the queue has room and something can be scheduled, else it
waits for the oldest batch's output and applies it.

Batches hold disjoint requests: a request in flight is skipped by the scheduler (scheduler.in_flight)
until its output is back, and the requests not in flight are spread evenly over the free slots, so a
handful of concurrent requests already fills the pipeline.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from vllmpy.engine.request import Request
from vllmpy.engine.schedule_types import ModelRunnerOutput, SchedulerOutput
from vllmpy.engine.scheduler import Scheduler


class PipelinedExecutor(Protocol):
    def submit(self, scheduler_output: SchedulerOutput) -> Any: ...

    def complete(self, pending: Any) -> ModelRunnerOutput: ...


class BatchQueue:
    def __init__(self, scheduler: Scheduler, executor: PipelinedExecutor, size: int) -> None:
        self.scheduler, self.executor, self.size = scheduler, executor, size
        self.queue: deque[tuple[SchedulerOutput, Any]] = deque()

    @property
    def busy(self) -> bool:
        return bool(self.queue)

    def step(self) -> tuple[list[Request], ModelRunnerOutput | None, SchedulerOutput]:
        """EngineCore.step under pipeline parallel: the requests the completed batch changed (none when
        this call only submitted one)."""
        if len(self.queue) < self.size:
            free = self.size - len(self.queue)
            idle = len(self.scheduler.requests.keys() - self.scheduler.in_flight)  # aborted ones may be in flight
            scheduler_output = self.scheduler.schedule(max_requests=max(1, -(-idle // free)))
            if not scheduler_output.is_empty:
                self.scheduler.in_flight.update(chunk.req_id for chunk in scheduler_output.chunks)
                self.queue.append((scheduler_output, self.executor.submit(scheduler_output)))
                if len(self.queue) < self.size:
                    return [], None, scheduler_output
        if not self.queue:
            return [], None, SchedulerOutput(chunks=[])
        scheduler_output, pending = self.queue.popleft()
        runner_output = self.executor.complete(pending)
        self.scheduler.in_flight.difference_update(chunk.req_id for chunk in scheduler_output.chunks)
        return self.scheduler.update_from_output(scheduler_output, runner_output), runner_output, scheduler_output
