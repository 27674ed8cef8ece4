"""Token-budget scheduler: one loop for prefill and decode, chunked prefill, preemption by recompute.

Each step hands `max_num_batched_tokens` to RUNNING requests first, then admits WAITING ones in policy
order while `max_num_seqs` allows. A prefill is a request far behind its tokens; a long one takes what
is left of the budget and continues next step, so chunked prefill needs no code path of its own.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from vllmpy.config import CacheConfig, SchedulerConfig
from vllmpy.engine.kv_cache_coordinator import KVCacheCoordinator
from vllmpy.engine.kv_cache_spec import KVCacheConfig
from vllmpy.engine.request import Request, RequestStatus
from vllmpy.engine.schedule_types import ModelRunnerOutput, NewRequestData, ScheduledChunk, SchedulerOutput
from vllmpy.engine.stop import apply_new_tokens
from vllmpy.multimodal.scheduling import EncoderScheduler
from vllmpy.spec_decode.drafter import Drafter
from vllmpy.spec_decode.proposer import DraftRequest

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
    running_lora_adapters: dict[str, int] = field(default_factory=dict)  # adapter name -> running requests
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    recurrent_snapshot_hits: int = 0  # admissions that resumed a recurrent state from a prefix snapshot
    recurrent_snapshot_bytes: int = 0  # recurrent state held by published snapshots
    recurrent_snapshots_taken: int = 0  # snapshots published since start
    recurrent_snapshot_slots: int = 0  # the snapshot pool's size; 0: no pool (no recurrent layers, or no caching)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class Scheduler:
    """Owns the request queues and the KV cache coordinator. Per step: schedule() -> runner ->
    update_from_output()."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_cache_config: KVCacheConfig,
                 max_model_len: int, drafter: Drafter | None = None, max_loras: int | None = None,
                 encoder: EncoderScheduler | None = None) -> None:
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
        self.drafter = drafter  # speculative decoding: drafts for running decodes (None = off)
        self._trimmed: dict[str, int] = {}  # block tables shortened since the last step (SchedulerOutput)
        self.max_loras = max_loras  # --max-loras with LoRA on: most distinct adapters among running requests
        self.encoder = encoder  # image rules for a model that takes images (None: text only)
        # Pipeline parallel: requests of micro-batches whose output has not come back (engine/batch_queue.py).
        # They are not scheduled, preempted or reported finished to the runner until it has.
        self.in_flight: set[str] = set()

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
        if request.mm_features and self.encoder is not None:
            self.encoder.check(request)
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
            if self.drafter is not None and not request.is_pooling:
                self.drafter.finish(req_id, request.all_token_ids, request.num_prompt_tokens)
            if self.encoder is not None:
                self.encoder.forget(req_id)

    def schedule(self, max_requests: int | None = None) -> SchedulerOutput:
        """max_requests: most requests in this batch (pipeline parallel spreads them over micro-batches)."""
        budget = self.config.max_num_batched_tokens
        limit = self.config.max_num_seqs if max_requests is None else max_requests
        chunks: dict[str, ScheduledChunk] = {}
        preempted: set[str] = set()
        drafting = self.drafter is not None and self.drafter.enabled_for(len(self.running))
        if drafting:  # the step's running decodes at once: a draft model drafts for them in batched forwards
            self.drafter.begin_step([DraftRequest(r.request_id, r.all_token_ids, r.num_prompt_tokens, room,
                                                  r.sampling_params)
                                     for r in self.running if (room := self._draft_room(r)) > 0])
        if self.encoder is not None:
            self.encoder.begin_step()

        for request in list(self.running):
            if budget == 0 or len(chunks) >= limit:
                break
            if request.request_id in self.in_flight:
                continue
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            # Until it gets its blocks or is itself the victim (then it waits for a later step).
            drafts = self._drafts(request, budget) if drafting else []
            while request.status == RequestStatus.RUNNING:
                num_new, images = self._fit_images(request, request.num_computed_tokens,
                                                   min(request.num_tokens - request.num_computed_tokens, budget))
                if num_new == 0:
                    break  # its next image does not fit this step's budgets
                if drafts and not self.kv.allocate_slots(request, num_new + len(drafts)):
                    drafts = []  # speculation never preempts anyone: retry without the drafts
                if drafts or self.kv.allocate_slots(request, num_new):
                    chunks[request.request_id] = self._make_chunk(request, num_new, drafts)
                    self._commit_images(request, chunks[request.request_id], images)
                    budget -= num_new + len(drafts)
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
            loras = self._running_loras()
            for request in self._waiting_in_policy_order():
                if budget == 0 or len(self.running) >= self.config.max_num_seqs or len(chunks) >= limit:
                    break
                lora = request.lora_request
                if (lora is not None and self.max_loras is not None and lora.lora_int_id not in loras
                        and len(loras) >= self.max_loras):
                    continue  # a step holds at most --max-loras adapters: it waits for one to finish (as vLLM)
                computed_blocks, num_cached = self.kv.get_computed_blocks(request)
                num_new = request.num_tokens - num_cached
                if not self.config.enable_chunked_prefill and num_new > budget:
                    break
                wanted = min(num_new, budget)
                num_new, images = self._fit_images(request, num_cached, wanted)
                if num_new == 0 or (num_new < wanted and not self.config.enable_chunked_prefill):
                    break  # its next image does not fit this step's budgets
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
                    kind=request.kind, lora_request=lora, mm_features=request.mm_features))
                if lora is not None:
                    loras.add(lora.lora_int_id)
                chunks[request.request_id] = self._make_chunk(request, num_new)
                self._commit_images(request, chunks[request.request_id], images)
                budget -= num_new

        finished = self._finished_ids - self.in_flight
        self._finished_ids -= finished
        trimmed, self._trimmed = self._trimmed, {}
        return SchedulerOutput(chunks=list(chunks.values()), new_requests=new_requests,
                               finished_req_ids=finished, preempted_req_ids=preempted, trimmed_blocks=trimmed)

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
            new_tokens = sampled.get(chunk.req_id) or []
            if chunk.num_draft_tokens:
                self._settle_drafts(request, chunk, len(new_tokens))
            status = apply_new_tokens(request, new_tokens, self.max_model_len,
                                      chunk.req_id in runner_output.grammar_terminated) if new_tokens else None
            # num_computed_tokens was advanced at schedule time (drafts rolled back to the verified ones);
            # the step has now written that KV. A stop inside an accepted run leaves fewer tokens than that.
            self.kv.cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))
            if status is not None:
                self.finish_requests(chunk.req_id, status)
            if new_tokens:
                updated.append(request)
        return updated

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Draft tokens for a running decode (one token behind), within the step's budget, max_tokens and
        max_model_len: the step may add drafts + 1 tokens to the request."""
        room = min(budget - 1, self._draft_room(request))
        if room <= 0:
            return []
        return self.drafter.propose(request.request_id, request.all_token_ids, request.num_prompt_tokens, room)

    def _draft_room(self, request: Request) -> int:
        """Most drafts max_tokens and max_model_len leave a running decode (0 for anything else)."""
        if request.is_pooling or request.num_tokens - request.num_computed_tokens != 1:
            return 0
        return min(request.max_tokens - request.num_output_tokens - 1, self.max_model_len - request.num_tokens - 1)

    def _settle_drafts(self, request: Request, chunk: ScheduledChunk, num_sampled: int) -> None:
        """Keep the KV of the accepted drafts only: computed tokens go back to the verified ones, blocks
        holding nothing but rejected positions return to the pool (so none is ever published)."""
        num_drafts = chunk.num_draft_tokens
        num_accepted = max(0, num_sampled - 1)  # the last sampled token is the bonus or the correction
        request.num_computed_tokens = chunk.start_pos + len(chunk.token_ids) - num_drafts + num_accepted
        keep = request.num_computed_tokens + 1  # + the new last token, computed next step
        if self.kv.trim(request, keep):
            self._trimmed[request.request_id] = -(-keep // self.kv.block_size)
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted
        self.drafter.record(request.request_id, num_drafts, num_accepted)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage, num_free_blocks=self.kv.num_free_blocks,
            num_blocks=self.kv.num_blocks, prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits, num_preemptions=self.num_preemptions,
            running_lora_adapters=_count_adapters(self.running), waiting_lora_adapters=_count_adapters(self.waiting),
            recurrent_snapshot_hits=self.kv.snapshot_hits, recurrent_snapshot_bytes=self.kv.snapshot_bytes,
            recurrent_snapshots_taken=self.kv.snapshots_taken, recurrent_snapshot_slots=self.kv.snapshot_slots)

    def _fit_images(self, request: Request, start: int, num_new: int) -> tuple[int, list[int]]:
        """The chunk shortened to what its images allow (multimodal/scheduling.py), and the images to encode."""
        if self.encoder is None or not request.mm_features:
            return num_new, []
        return self.encoder.fit(request, start, num_new)

    def _commit_images(self, request: Request, chunk: ScheduledChunk, images: list[int]) -> None:
        if images:
            self.encoder.commit(request, images)
            chunk.encoder_inputs = images

    def _running_loras(self) -> set[int]:
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _make_chunk(self, request: Request, num_new: int, drafts: Sequence[int] = ()) -> ScheduledChunk:
        """Slice the next `num_new` tokens (then the drafts) and advance num_computed_tokens now (as vLLM
        v1); update_from_output rolls the rejected drafts back."""
        start = request.num_computed_tokens
        request.num_computed_tokens = start + num_new + len(drafts)
        resume, snapshots = self.kv.snapshot_plan(request, start, num_new, len(drafts))  # recurrent layers
        return ScheduledChunk(
            req_id=request.request_id, token_ids=request.all_token_ids[start:start + num_new] + list(drafts),
            start_pos=start, new_block_ids=self.kv.new_block_ids(request.request_id),
            sample=start + num_new == request.num_tokens, num_draft_tokens=len(drafts), resume_snapshot=resume,
            save_snapshots=snapshots,
            draft_probs=self.drafter.draft_probs(request.request_id, len(drafts)) if drafts else None)

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
        candidates = [r for r in self.running if r.request_id not in self.in_flight]
        if self.config.scheduling_policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return max(candidates, key=lambda r: r.arrival_time)

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks; it recomputes from scratch (prefix cache permitting) later."""
        self.running.remove(request)
        self.kv.free(request)
        if self.drafter is not None:
            self.drafter.preempt(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if self.encoder is not None:
            self.encoder.forget(request.request_id)
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.num_preemptions += 1


def _count_adapters(requests: Iterable[Request]) -> dict[str, int]:
    """LoRA adapter name -> how many of these requests run on it (vLLM's lora_requests_info labels)."""
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_request is not None:
            counts[request.lora_request.lora_name] = counts.get(request.lora_request.lora_name, 0) + 1
    return counts
