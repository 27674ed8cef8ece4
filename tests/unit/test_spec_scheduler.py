"""The scheduler under speculative decoding, against the fake model of tests/kv_harness.py: drafts that
are right or wrong at random give exactly the tokens of decoding one at a time; the KV read back for every
chunk is its tokens' (rejected drafts' slots are rewritten before anyone reads them); no block is ever
published with an unverified token; blocks holding only rejected drafts go back to the pool; every
block is back when idle."""
from __future__ import annotations

import random

import pytest

from tests.kv_harness import FakeRunner, expected_outputs, full, kv_config, next_token, random_requests, sliding, step
from vllmpy.config import CacheConfig, SchedulerConfig
from vllmpy.engine.scheduler import Scheduler
from vllmpy.spec_decode.config import SpeculativeConfig
from vllmpy.spec_decode.drafter import Drafter

BLOCK = 4


class RandomProposer:
    """Up to k drafts, each the fake model's next token with probability `right`, else a random one."""

    def __init__(self, rng: random.Random, right: float = 0.7) -> None:
        self.rng = rng
        self.right = right
        self.finished: set[str] = set()

    def propose(self, req_id, token_ids, num_prompt_tokens, k):
        context, drafts = list(token_ids), []
        for _ in range(self.rng.randrange(0, k + 1)):
            token = next_token(context) if self.rng.random() < self.right else self.rng.randrange(1, 51)
            drafts.append(token)
            context.append(token)
        return drafts

    def on_request_finished(self, req_id, token_ids, num_prompt_tokens):
        self.finished.add(req_id)


def _drafter(proposer, k: int = 4, disable_by_batch_size: int = 64) -> Drafter:
    return Drafter(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": k,
                                            "disable_by_batch_size": disable_by_batch_size}), proposer)


@pytest.mark.parametrize("windows", [(None,), (None, 6)])
@pytest.mark.parametrize("seed", range(5))
def test_random_drafts_give_the_tokens_of_plain_decoding(seed, windows):
    rng = random.Random(seed)
    specs = [full(BLOCK) if w is None else sliding(BLOCK, w) for w in windows]
    proposer = RandomProposer(rng)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=rng.choice([8, 16, 64])),
                          CacheConfig(block_size=BLOCK), kv_config(rng.choice([40, 96]), BLOCK, specs),
                          max_model_len=128, drafter=_drafter(proposer))
    runner = FakeRunner(BLOCK, windows)
    requests = random_requests(rng, prefix_len=12, max_suffix=10, max_tokens=14, count=16)
    for request in requests:
        scheduler.add_request(request)
    drafted = 0
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner)
        drafted += sum(c.num_draft_tokens for c in out.chunks)
        for request in scheduler.running:
            assert request.all_token_ids == request.prompt_token_ids + expected_outputs(
                request.prompt_token_ids, request.num_output_tokens)
            assert scheduler.kv._num_published.get(request.request_id, 0) * BLOCK <= request.num_computed_tokens
            assert request.num_computed_tokens < request.num_tokens
            for table in scheduler.kv.block_ids(request.request_id):
                assert len(table) <= -(-request.num_tokens // BLOCK), "a block of rejected drafts was kept"
    for request in requests:
        assert request.output_token_ids == expected_outputs(request.prompt_token_ids, request.max_tokens)
    stats = scheduler.drafter.stats
    assert drafted == stats.num_draft_tokens > stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens == sum(r.num_accepted_tokens for r in requests)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert proposer.finished == {r.request_id for r in requests}


def test_drafts_stay_inside_budget_max_tokens_and_max_model_len():
    class Greedy(RandomProposer):
        def propose(self, req_id, token_ids, num_prompt_tokens, k):
            return [next_token(list(token_ids))] * k

    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6), CacheConfig(block_size=BLOCK),
                          kv_config(64, BLOCK), max_model_len=20, drafter=_drafter(Greedy(random.Random(0)), k=8))
    runner = FakeRunner(BLOCK)
    a, b = random_requests(random.Random(1), prefix_len=4, max_suffix=3, max_tokens=2, count=2)
    a.max_tokens, b.max_tokens = 9, 30  # b runs into max_model_len
    scheduler.add_request(a)
    scheduler.add_request(b)
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner)
        assert out.num_batched_tokens <= 6
        assert all(c.start_pos + len(c.token_ids) < 20 for c in out.chunks)  # room for the bonus token
        assert a.num_output_tokens <= 9
    assert a.num_output_tokens == 9 and b.num_tokens == 20


def test_speculation_never_preempts_and_backs_off_above_the_batch_size():
    """A pool that fits the requests but not all their drafts: drafts are dropped, nobody is preempted.
    Above disable_by_batch_size running requests no chunk carries drafts."""
    requests = random_requests(random.Random(2), prefix_len=6, max_suffix=4, max_tokens=2, count=3)
    for request, max_tokens in zip(requests, (4, 10, 24)):
        request.max_tokens = max_tokens
    num_blocks = sum(-(-(r.num_prompt_tokens + r.max_tokens) // BLOCK) for r in requests)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), CacheConfig(block_size=BLOCK),
                          kv_config(num_blocks, BLOCK), max_model_len=48,
                          drafter=_drafter(RandomProposer(random.Random(0), right=1.0), k=8, disable_by_batch_size=2))
    runner = FakeRunner(BLOCK)
    for request in requests:
        scheduler.add_request(request)
    drafted_alone = False
    while scheduler.has_unfinished_requests():
        num_running = len(scheduler.running)
        out, _ = step(scheduler, runner)
        drafts = sum(c.num_draft_tokens for c in out.chunks)
        assert num_running <= 2 or drafts == 0
        drafted_alone |= drafts > 0
    assert drafted_alone and scheduler.num_preemptions == 0
    assert all(r.output_token_ids == expected_outputs(r.prompt_token_ids, r.max_tokens) for r in requests)
