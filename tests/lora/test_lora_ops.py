"""The batched delta against a row-by-row reference, and the scheduler's --max-loras bound."""
from __future__ import annotations

import random

import pytest
import torch

from tests.kv_harness import FakeRunner, expected_outputs, kv_config, make_request, step
from vllmpy.config import CacheConfig, SchedulerConfig
from vllmpy.engine.scheduler import Scheduler
from vllmpy.layers.linear import Linear, MergedLinear
from vllmpy.lora.checkpoint import ShardDelta
from vllmpy.lora.layer import LoRALayer, LoRAMapping, LoRAStep
from vllmpy.lora.request import LoRARequest

MAX_LORAS, MAX_RANK = 4, 8


def _layer(merged: bool) -> Linear:
    layer = MergedLinear(24, {"q": 16, "k": 8, "v": 8}) if merged else Linear(24, 20)
    torch.nn.init.normal_(layer.weight)
    return layer


def _random_deltas(layer: Linear, rng: torch.Generator) -> list[ShardDelta]:
    """A random adapter for the layer: per shard (some left out) or the whole module, one random rank."""
    shards = list(getattr(layer, "shard_offsets", {}).items())
    if not shards or torch.rand(1, generator=rng) < 0.3:
        shards = [(None, (0, layer.out_features))]
    rank = int(torch.randint(1, MAX_RANK + 1, (1,), generator=rng))
    deltas = []
    for block, (_, (offset, size)) in enumerate(shards):
        if len(shards) > 1 and torch.rand(1, generator=rng) < 0.3:
            continue
        deltas.append(ShardDelta(block, offset, torch.randn(rank, layer.in_features, generator=rng),
                                 torch.randn(size, rank, generator=rng)))
    return deltas


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("merged", [False, True])
def test_batched_delta_equals_row_by_row(seed, merged):
    rng = torch.Generator().manual_seed(seed)
    layer, step_state = _layer(merged), LoRAStep()
    lora = LoRALayer(layer, step_state, MAX_LORAS, MAX_RANK, torch.float32, torch.device("cpu"))
    adapters = [_random_deltas(layer, rng) for _ in range(MAX_LORAS)]
    for slot, deltas in enumerate(adapters):
        lora.write(slot, deltas)
    chunks = [(int(torch.randint(-1, MAX_LORAS, (1,), generator=rng)), int(torch.randint(1, 5, (1,), generator=rng)))
              for _ in range(int(torch.randint(1, 7, (1,), generator=rng)))]
    x = torch.randn(sum(n for _, n in chunks), layer.in_features, generator=rng)
    base = layer(x)
    step_state.mapping = LoRAMapping.build(chunks, torch.device("cpu"))
    layer.lora = lora
    got = layer(x)
    expected = base.clone()
    row = 0
    for slot, count in chunks:
        for r in range(row, row + count):
            for delta in (adapters[slot] if slot >= 0 else []):
                columns = slice(delta.out_offset, delta.out_offset + delta.b.shape[0])
                expected[r, columns] += delta.b @ (delta.a @ x[r])
        row += count
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    if all(slot < 0 for slot, _ in chunks):
        assert step_state.mapping is None  # base rows only: the op is skipped


def test_rewriting_a_slot_forgets_the_previous_adapter():
    rng = torch.Generator().manual_seed(0)
    layer, step_state = _layer(True), LoRAStep()
    lora = layer.lora = LoRALayer(layer, step_state, MAX_LORAS, MAX_RANK, torch.float32, torch.device("cpu"))
    x = torch.randn(3, layer.in_features, generator=rng)
    base = layer(x)
    lora.write(2, _random_deltas(layer, rng))
    lora.write(2, None)  # the next adapter in slot 2 does not target this layer
    step_state.mapping = LoRAMapping.build([(2, 3)], torch.device("cpu"))
    assert torch.equal(layer(x), base)


def test_scheduler_keeps_distinct_adapters_per_step_within_max_loras():
    """Random requests on 5 adapters (and the base model) under --max-loras 2: every step holds at most
    2 adapters among its running requests, and every request still finishes with the fake model's tokens."""
    rng = random.Random(0)
    adapters = [LoRARequest(f"a{i}", i + 1, "/unused") for i in range(5)]
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), CacheConfig(block_size=4),
                          kv_config(256, 4), max_model_len=512, max_loras=2)
    runner = FakeRunner(4)
    requests: list = []
    for i in range(30):
        request = make_request(f"r{i}", [rng.randrange(1, 50) for _ in range(rng.randrange(2, 12))],
                               max_tokens=rng.randrange(1, 6), arrival=float(i))
        request.lora_request = rng.choice([None, *adapters])
        requests.append(request)
        scheduler.add_request(request)
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        out, _ = step(scheduler, runner)
        for new in out.new_requests:  # the runner learns each request's adapter
            assert new.lora_request is requests[int(new.req_id[1:])].lora_request
        running = {r.lora_request.lora_int_id for r in scheduler.running if r.lora_request is not None}
        assert len(running) <= 2
    assert not scheduler.has_unfinished_requests()
    for request in requests:
        assert request.output_token_ids == expected_outputs(request.prompt_token_ids, request.max_tokens)
