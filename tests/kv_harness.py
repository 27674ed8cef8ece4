"""Scheduler/KV-cache test harness: KV cache configs, and a fake runner that checks every block table.

The fake runner keeps a simulated paged KV cache (one token per slot, tagged with the group that wrote
it: groups share the pool, so a block held by two groups at once shows up) and each request's block
tables, built from the chunks' new_block_ids as the real runner builds them; for every chunk it reads
back each group's keys that the chunk's queries can see: the whole context for full attention, the
last `window` positions before each query for a sliding window. A wrong block table, a shared block
overwritten, an evicted block still in use, or a window's block freed too early is a mismatch.
"""
from __future__ import annotations

import random

import torch

from vllmpy.engine.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheLayout, SlidingWindowSpec
from vllmpy.engine.request import Request, RequestStatus
from vllmpy.engine.schedule_types import ModelRunnerOutput, SchedulerOutput
from vllmpy.engine.scheduler import Scheduler
from vllmpy.sampling_params import SamplingParams


def full(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, 1, 1, torch.float32)


def sliding(block_size: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size, 1, 1, torch.float32, window)


def kv_config(num_blocks: int, block_size: int, specs=None, max_model_len: int = 1 << 20) -> KVCacheConfig:
    """`specs`: one per layer (default: one full-attention layer); page sizes are irrelevant here."""
    return KVCacheConfig(num_blocks, KVCacheLayout.from_specs(specs or [full(block_size)], max_model_len))


def make_request(req_id, tokens, max_tokens=4, arrival=None, priority=0, **params) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=max_tokens, **params),
                   arrival_time=arrival, priority=priority)


def random_requests(rng: random.Random, prefix_len: int, max_suffix: int, max_tokens: int,
                    count: int = 40) -> list[Request]:
    """Prompts that share some of three random prefixes (so prefix hits happen), in arrival order."""
    prefixes = [[rng.randrange(1, 50) for _ in range(prefix_len)] for _ in range(3)]
    requests = []
    for i in range(count):
        prompt = rng.choice(prefixes)[:rng.randrange(0, prefix_len + 1)] + [
            rng.randrange(1, 50) for _ in range(rng.randrange(1, max_suffix))]
        requests.append(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, max_tokens), arrival=float(i),
                                     priority=rng.randrange(3)))
    return requests


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the whole context."""
    return (sum(context) * 31 + len(context)) % 50 + 1


class FakeRunner:
    def __init__(self, block_size: int, windows: tuple[int | None, ...] = (None,)) -> None:
        """windows: per KV cache group, None for full attention."""
        self.block_size = block_size
        self.windows = windows
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}  # (block id, offset) -> (group, token id)
        self.tokens: dict[str, list[int]] = {}  # what the runner believes each request's tokens are
        self.num_computed: dict[str, int] = {}
        self.tables: dict[str, list[list[int]]] = {}  # per request, each group's table from the deltas

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.tokens.pop(req_id, None)
            self.num_computed.pop(req_id, None)
            self.tables.pop(req_id, None)
        new_ids = set()
        for new in out.new_requests:
            self.tokens[new.req_id] = new.prompt_token_ids + new.output_token_ids
            self.tables[new.req_id] = [[] for _ in self.windows]
            new_ids.add(new.req_id)
        for req_id, num_blocks in out.trimmed_blocks.items():
            for table in self.tables.get(req_id, ()):
                del table[num_blocks:]
        sampled = []
        for chunk in out.chunks:
            # The runner's tokens, then the chunk's drafts (speculative decoding) while this step runs.
            drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens:]
            tokens = self.tokens[chunk.req_id] + drafts
            if chunk.req_id in new_ids:
                self.num_computed[chunk.req_id] = chunk.start_pos  # prefix hit skips the start
            assert chunk.start_pos == self.num_computed[chunk.req_id]
            end = chunk.start_pos + len(chunk.token_ids)
            assert chunk.token_ids == tokens[chunk.start_pos:end]
            assert len(chunk.new_block_ids) == len(self.windows)
            for table, added in zip(self.tables[chunk.req_id], chunk.new_block_ids):
                table.extend(added)
            for group, (table, window) in enumerate(zip(self.tables[chunk.req_id], self.windows)):
                assert len(table) * self.block_size >= end
                for pos in range(chunk.start_pos, end):
                    self.slots[self.slot(table, pos)] = (group, tokens[pos])
                first = 0 if window is None else max(0, chunk.start_pos - window + 1)
                context = [self.slots.get(self.slot(table, p)) for p in range(first, end)]
                assert context == [(group, t) for t in tokens[first:end]], \
                    f"{chunk.req_id}: group {group}'s KV read back differs from its tokens"
            assert chunk.sample == (end == len(tokens))
            kept = self._verify(self.tokens[chunk.req_id], drafts) if chunk.sample else []
            self.num_computed[chunk.req_id] = end - len(drafts) + max(0, len(kept) - 1)
            self.tokens[chunk.req_id] += kept
            sampled.append(kept)
        return ModelRunnerOutput(req_ids=[c.req_id for c in out.chunks], sampled_token_ids=sampled,
                                 logprobs=[None] * len(out.chunks))

    @staticmethod
    def _verify(tokens: list[int], drafts: list[int]) -> list[int]:
        """Greedy verification against the fake model: drafts while they are its tokens, then its token."""
        kept = []
        for draft in drafts + [None]:
            token = next_token(tokens + kept)
            kept.append(token)
            if token != draft:
                return kept
        return kept

    def slot(self, block_ids: list[int], pos: int) -> tuple[int, int]:
        return block_ids[pos // self.block_size], pos % self.block_size


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step, with the engine's own max_tokens stop check."""
    out = scheduler.schedule()
    updated = scheduler.update_from_output(out, runner.execute(out))
    done = [r.request_id for r in updated if not r.is_finished and r.num_output_tokens >= r.max_tokens]
    scheduler.finish_requests(done, RequestStatus.FINISHED_LENGTH_CAPPED)
    return out, updated


def expected_outputs(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]
