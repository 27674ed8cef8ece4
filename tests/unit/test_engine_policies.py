"""Engine-level scheduling policies: with one seat, the order requests finish in follows the policy."""
from __future__ import annotations

import pytest

from vllmpy import SamplingParams


def _finish_order(model_dir: str, policy: str, requests: list[tuple[str, int]]) -> list[str]:
    from vllmpy import LLM

    llm = LLM(model=model_dir, num_blocks=64, max_model_len=256, max_num_seqs=1, scheduling_policy=policy)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for request_id, priority in requests:
        llm.engine.add_request(request_id, "Hello there", params, priority=priority)
    order = []
    while llm.engine.has_unfinished_requests():
        order.extend(o.request_id for o in llm.engine.step() if o.finished)
    return order


@pytest.mark.parametrize("policy, expected", [("fcfs", ["a", "b", "c", "d"]), ("priority", ["c", "d", "a", "b"])])
def test_policy_orders_completion(tiny_llama_dir, policy, expected):
    # Lower priority value first; ties by arrival.
    assert _finish_order(tiny_llama_dir, policy, [("a", 5), ("b", 5), ("c", 0), ("d", 1)]) == expected


def test_priority_through_generate(tiny_llama_dir):
    from vllmpy import LLM

    llm = LLM(model=tiny_llama_dir, num_blocks=64, max_model_len=256, max_num_seqs=1, scheduling_policy="priority")
    outputs = llm.generate(["one", "two", "three"], SamplingParams(max_tokens=2, ignore_eos=True),
                           priority=[2, 1, 0], use_tqdm=False)
    assert [o.prompt for o in outputs] == ["one", "two", "three"]  # results come back in prompt order
    assert outputs[2].metrics.finished_time <= outputs[1].metrics.finished_time <= outputs[0].metrics.finished_time
