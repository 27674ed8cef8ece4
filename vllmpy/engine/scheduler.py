"""Token-budget scheduler: one loop for prefill and decode, chunked prefill, preemption by recompute.

Each step hands `max_num_batched_tokens` to RUNNING requests first, then admits WAITING ones in policy
order while `max_num_seqs` allows. A prefill is a request far behind its tokens; a long one takes what
is left of the budget and continues next step, so chunked prefill needs no code path of its own.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from vllmpy.config import CacheConfig, SchedulerConfig
from vllmpy.engine.kv_cache_coordinator import KVCacheCoordinator
from vllmpy.engine.kv_cache_spec import KVCacheConfig
from vllmpy.engine.request import Request, RequestStatus
from vllmpy.engine.schedule_types import ModelRunnerOutput, NewRequestData, ScheduledChunk, SchedulerOutput
from vllmpy.engine.stop import apply_new_tokens

# Above this many waiting requests lpm falls back to fcfs for the step, bounding the lookup cost
# (SGLang does the same).
LPM_MAX_WAITING = 128


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks held by requests
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int  # total since start

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class Scheduler:
    """Owns the request queues and the KV cache coordinator. Per step: schedule() -> runner ->
    update_from_output()."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_cache_config: KVCacheConfig,
                 max_model_len: int) -> None:
        needed = kv_cache_config.layout.blocks_per_request(max_model_len, scheduler_config.max_num_batched_tokens)
        if kv_cache_config.num_blocks < needed:
            # A lone request could then outgrow the pool and stall forever (memory.py refuses it first).
            raise ValueError(f"KV pool of {kv_cache_config.num_blocks} blocks x {kv_cache_config.block_size} "
                             f"tokens cannot hold one sequence of max_model_len {max_model_len} ({needed} blocks)")
        if not scheduler_config.enable_chunked_prefill and \
                scheduler_config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"--max-num-batched-tokens ({scheduler_config.max_num_batched_tokens}) is smaller than "
                f"--max-model-len ({max_model_len}) with chunked prefill disabled, so a long prompt "
                f"could never be scheduled; raise --max-num-batched-tokens, lower --max-model-len, or "
                f"enable chunked prefill")
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.kv = KVCacheCoordinator(kv_cache_config, cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}  # waiting + running
        self.waiting: deque[Request] = deque()  # arrival order; resumed (preempted) requests in front
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._finished_ids: set[str] = set()  # reported to the runner in the next SchedulerOutput

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt must contain at least one token")
        # A pooled prompt may fill the context; a generated one must leave room for one token.
        room = 0 if request.is_pooling else 1
        if request.num_prompt_tokens + room > self.max_model_len:
            raise ValueError(f"the prompt is {request.num_prompt_tokens} tokens long, but max_model_len "
                             f"is {self.max_model_len}: the prompt must be shorter"
                             + (", leaving room for at least one generated token" if room else ""))
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_requests(self, req_ids: str | Iterable[str]) -> None:
        self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests now and free their blocks; unknown or already finished ids are ignored."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        for req_id in [req_ids] if isinstance(req_ids, str) else req_ids:
            request = self.requests.pop(req_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self.kv.free(request)
            request.status = status
            self._finished_ids.add(req_id)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: dict[str, ScheduledChunk] = {}
        preempted: set[str] = set()

        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            # Until it gets its blocks or is itself the victim (then it waits for a later step).
            while request.status == RequestStatus.RUNNING:
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                if self.kv.allocate_slots(request, num_new):
                    chunks[request.request_id] = self._make_chunk(request, num_new)
                    budget -= num_new
                    break
                victim = self._pick_victim()
                dropped = chunks.pop(victim.request_id, None)  # the victim may already hold a chunk
                if dropped is not None:
                    budget += len(dropped.token_ids)
                self._preempt(victim)
                preempted.add(victim.request_id)

        new_requests: list[NewRequestData] = []
        # After a preemption memory is tight: admit nobody this step (as vLLM), or we would thrash.
        if not preempted:
            for request in self._waiting_in_policy_order():
                if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                    break
                computed_blocks, num_cached = self.kv.get_computed_blocks(request)
                num_new = request.num_tokens - num_cached
                if not self.config.enable_chunked_prefill and num_new > budget:
                    break
                num_new = min(num_new, budget)
                if not self.kv.allocate_slots(request, num_new, computed_blocks):
                    break  # head of line waits for blocks; skipping it would starve long prompts
                self.waiting.remove(request)
                self.running.append(request)
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_cached
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_cached
                new_requests.append(NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=list(request.prompt_token_ids),
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params, pooling_params=request.pooling_params,
                    kind=request.kind))
                chunks[request.request_id] = self._make_chunk(request, num_new)
                budget -= num_new

        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(chunks=list(chunks.values()), new_requests=new_requests,
                               finished_req_ids=finished, preempted_req_ids=preempted)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[Request]:
        """Append sampled tokens through the stop pass (engine/stop.py) and publish newly full blocks;
        return the requests that changed, finished where the runner failed them or a token stopped them.
        """
        updated: list[Request] = []
        for req_id, message in runner_output.errors.items():
            request = self.requests.get(req_id)
            if request is not None:
                request.error = message
                self.finish_requests(req_id, RequestStatus.FINISHED_ERROR)
                updated.append(request)

        sampled = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True))
        for chunk in scheduler_output.chunks:
            request = self.requests.get(chunk.req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or preempted since it was scheduled
            # num_computed_tokens was advanced at schedule time; the step has now written that KV.
            self.kv.cache_blocks(request, request.num_computed_tokens)
            new_tokens = sampled.get(chunk.req_id)
            if not new_tokens:
                continue
            status = apply_new_tokens(request, new_tokens, self.max_model_len,
                                      chunk.req_id in runner_output.grammar_terminated)
            if status is not None:
                self.finish_requests(chunk.req_id, status)
            updated.append(request)
        return updated

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage, num_free_blocks=self.kv.num_free_blocks,
            num_blocks=self.kv.num_blocks, prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits, num_preemptions=self.num_preemptions)

    def _make_chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        """Slice the next `num_new` tokens and advance num_computed_tokens now (as vLLM v1)."""
        start = request.num_computed_tokens
        request.num_computed_tokens = start + num_new
        return ScheduledChunk(
            req_id=request.request_id, token_ids=request.all_token_ids[start:start + num_new],
            start_pos=start, block_ids=self.kv.block_ids(request.request_id),
            sample=start + num_new == request.num_tokens)

    def _waiting_in_policy_order(self) -> list[Request]:
        policy = self.config.scheduling_policy
        if policy == "priority":
            return sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        if policy == "lpm" and len(self.waiting) <= LPM_MAX_WAITING:
            # Longest cached prefix first; sorted() is stable, so ties keep fcfs order.
            return sorted(self.waiting, key=lambda r: -self.kv.get_computed_blocks(r)[1])
        return list(self.waiting)

    def _pick_victim(self) -> Request:
        """The lowest-priority running request: the latest arrival (or largest priority value)."""
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return max(self.running, key=lambda r: r.arrival_time)

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks; it recomputes from scratch (prefix cache permitting) later."""
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.num_preemptions += 1
