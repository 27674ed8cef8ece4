"""The scheduler with images (vllmpy/multimodal/scheduling.py): every chunk that reaches an image has it
encoded this step or earlier (once per start), within the per-step encoder budget; with whole spans a
chunk never ends inside one; preemption re-encodes; the prefix cache keys blocks by the images they show."""
from __future__ import annotations

import random

import numpy as np
import pytest

from tests.kv_harness import FakeRunner, expected_outputs, kv_config, step
from vllmpy.config import CacheConfig, SchedulerConfig
from vllmpy.engine.request import Request, RequestStatus
from vllmpy.engine.scheduler import Scheduler
from vllmpy.multimodal.inputs import ImageFeature
from vllmpy.multimodal.scheduling import EncoderScheduler
from vllmpy.sampling_params import SamplingParams

BS = 4
IMAGE_TOKEN = 7


def _scheduler(budget: int, encoder_budget: int, whole_spans: bool, num_blocks: int = 64,
               max_model_len: int = 96) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget)
    return Scheduler(config, CacheConfig(block_size=BS), kv_config(num_blocks, BS), max_model_len,
                     encoder=EncoderScheduler(encoder_budget, budget, whole_spans, chunked_prefill=True))


def _request(req_id: str, prompt_parts: list, max_tokens: int = 6, arrival: float = 0.0) -> Request:
    """prompt_parts: token ids, and (length, hash) tuples for images."""
    tokens, features = [], []
    for part in prompt_parts:
        if isinstance(part, tuple):
            length, digest = part
            features.append(ImageFeature(np.zeros(1, np.float32), len(tokens), length, digest))
            tokens += [IMAGE_TOKEN] * length
        else:
            tokens.append(part)
    return Request(req_id, tokens, SamplingParams(max_tokens=max_tokens), arrival_time=arrival,
                   mm_features=features)


def _random_request(rng: random.Random, index: int) -> Request:
    parts = []
    for _ in range(rng.randrange(1, 4)):
        parts += [rng.randrange(10, 50) for _ in range(rng.randrange(0, 6))]
        parts.append((rng.randrange(2, 9), f"img{rng.randrange(3)}"))
    parts += [rng.randrange(10, 50) for _ in range(rng.randrange(1, 5))]
    return _request(f"r{index}", parts, max_tokens=rng.randrange(1, 8), arrival=float(index))


@pytest.mark.parametrize("whole_spans", [True, False])
def test_randomized_image_rules_hold(whole_spans):
    rng = random.Random(7 + whole_spans)
    budget, encoder_budget = 12, 10
    scheduler = _scheduler(budget, encoder_budget, whole_spans, num_blocks=16, max_model_len=56)
    runner = FakeRunner(BS)
    pending = [_random_request(rng, i) for i in range(40)]
    everything = {r.request_id: r for r in pending}
    encoded: dict[str, set[int]] = {}  # per request since its last (re)start
    for _ in range(3000):
        if pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop(0))
        if not pending and not scheduler.has_unfinished_requests():
            break
        out, _ = step(scheduler, runner)
        for req_id in out.preempted_req_ids | {n.req_id for n in out.new_requests}:
            encoded[req_id] = set()
        assert sum(everything[c.req_id].mm_features[i].length for c in out.chunks for i in c.encoder_inputs) \
            <= encoder_budget
        for chunk in out.chunks:
            start, end = chunk.start_pos, chunk.start_pos + len(chunk.token_ids)
            done = encoded[chunk.req_id]
            assert not done & set(chunk.encoder_inputs), "an image was encoded twice in one start"
            done.update(chunk.encoder_inputs)
            for index, feature in enumerate(everything[chunk.req_id].mm_features):
                if feature.overlaps(start, end):
                    assert index in done, f"{chunk.req_id}: image {index} reached before it was encoded"
                    if whole_spans:
                        assert end >= feature.end, f"{chunk.req_id}: a chunk ends inside image {index}"
    else:
        pytest.fail("requests did not finish")
    assert scheduler.stats().num_preemptions > 0  # the small pool forces some: they re-encode
    for request in everything.values():
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert request.output_token_ids == expected_outputs(request.prompt_token_ids, request.max_tokens)


def test_prefix_cache_is_keyed_by_image_content():
    scheduler = _scheduler(budget=64, encoder_budget=64, whole_spans=True)
    runner = FakeRunner(BS)
    text = [11, 12, 13, 14, 15, 16]
    cached = {}
    for name, digest in (("a", "hash-a"), ("b", "hash-b"), ("a2", "hash-a")):
        request = _request(name, text + [(8, digest)] + [21, 22, 23, 24, 25])
        scheduler.add_request(request)
        while scheduler.has_unfinished_requests():
            step(scheduler, runner)
        cached[name] = request.num_cached_tokens
    offset = len(text)
    assert cached["a"] == 0
    assert cached["b"] == offset // BS * BS, "a different image reused the first image's blocks"
    assert cached["a2"] > offset + 8, "the same image missed the cache"


def test_requests_no_step_could_schedule_are_refused():
    with pytest.raises(ValueError, match="--max-num-encoder-input-tokens is 4"):
        _scheduler(budget=16, encoder_budget=4, whole_spans=False).add_request(_request("x", [1, (6, "h"), 2]))
    with pytest.raises(ValueError, match="--max-num-batched-tokens is 8"):
        _scheduler(budget=8, encoder_budget=16, whole_spans=True).add_request(_request("x", [1, (12, "h"), 2]))
