"""Decode replay (vllmpy/layers/decode_replay.py): replayed decode steps give the modules' tokens and logprobs
bit for bit through changing batches and outgrown block tables, and a stack that computes in torch, carries
hooks or meets a kernel answering otherwise is run as modules."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from vllmpy.kernels import block_kernels
from vllmpy.layers import decode_replay
from vllmpy.layers.decode_replay import DecodeReplay, _ViewsOnly

pytestmark = pytest.mark.skipif(block_kernels() is None, reason="no C compiler: nothing runs as kernels alone")


@pytest.fixture(scope="module")
def llm():
    from vllmpy import LLM
    return LLM(dtype="float32", num_blocks=256, max_model_len=1024, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_gguf_path):
    """A Llama-family stack: its pre-norm residual adds are kernel calls too (`add_norm` without a branch norm)."""
    from vllmpy import LLM
    return LLM(model=smollm2_gguf_path, dtype="float32", num_blocks=256, max_model_len=1024,
               enable_prefix_caching=False)


def _replay(llm) -> DecodeReplay:
    return llm.engine.core.model.model.decode_replay


def _run(llm, seed: int) -> list[tuple[list[int], list]]:
    """Requests of random prompt and output lengths (the batch shrinks as they finish, block tables widen)."""
    from vllmpy import SamplingParams

    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(rng.randrange(3, 40))]}
               for _ in range(rng.randrange(2, 7))]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(5, 60), ignore_eos=True, logprobs=2)
              for _ in prompts]
    return [(o.outputs[0].token_ids, [sorted((k, v.logprob) for k, v in step.items()) for step in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("model,seed", [("llm", 0), ("llm", 1), ("llm", 2), ("smollm2_llm", 0)])
def test_replayed_steps_equal_the_modules_bit_for_bit(model, seed, monkeypatch, request):
    llm = request.getfixturevalue(model)
    monkeypatch.setattr(decode_replay, "_MIN_TABLE_COLUMNS", 1)  # tables outgrown every power of two: re-recorded
    replay = _replay(llm)
    replay.plans.clear()
    replayed = []
    real = decode_replay._Plan.replay
    monkeypatch.setattr(decode_replay._Plan, "replay",
                        lambda plan, *args: replayed.append(plan) or real(plan, *args))
    with_replay = _run(llm, seed)
    assert len(replayed) > 10 and not replay.refused and len({id(p) for p in replayed}) > 1
    monkeypatch.setattr(DecodeReplay, "run", lambda self, layers, *args: layers(*args))
    assert with_replay == _run(llm, seed)


def test_hooks_keep_the_modules(llm):
    replay = _replay(llm)
    replay.plans.clear()
    replay.refused.clear()
    calls = []
    handle = llm.engine.core.model.model.layers[3].register_forward_hook(lambda *args: calls.append(1))
    try:
        _run(llm, 3)
    finally:
        handle.remove()
    assert not replay.plans and replay.refused and len(calls) > 20  # the hook ran on every step
    replay.refused.clear()


def test_a_kernel_answering_otherwise_falls_back_to_the_modules(llm, monkeypatch):
    from vllmpy import SamplingParams

    replay = _replay(llm)
    replay.plans.clear()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompt = {"prompt_token_ids": list(range(1000, 1020))}
    want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    (plan,) = replay.plans.values()
    kernel, args, _ = plan.calls[-1]  # as if the last call had returned something else when recorded
    plan.calls[-1] = (kernel, args, "recorded otherwise")
    answers = []
    real = decode_replay._Plan.replay
    monkeypatch.setattr(decode_replay._Plan, "replay", lambda p, *a: answers.append(real(p, *a)) or answers[-1])
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    assert answers[0] is None and all(a is not None for a in answers[1:])  # dropped, then recorded anew
    assert plan not in replay.plans.values() and len(answers) > 5


def test_views_only_names_the_first_op_that_computes():
    x, row, index = torch.randn(4, 6), torch.ones(1, 6), torch.tensor([1])
    with torch.inference_mode():
        with _ViewsOnly() as mode:
            y = torch.empty(4, 6)
            x.view(2, 12).split_with_sizes((1, 1), 0)
            x.float().reshape(-1)
            x[:, :2].t()
        assert mode.computed is None and any(t is y for t in mode.held)
        for compute in (lambda: x + 1, lambda: x.index_copy_(0, index, row), lambda: x.sum().item(),
                        lambda: x.t().contiguous(), lambda: x.to(torch.float64), lambda: x.__iadd__(1),
                        lambda: x.__setitem__(0, 1.0), lambda: torch.add(x, 1, out=x), lambda: x.abs().max().item()):
            with _ViewsOnly() as mode:
                compute()
            assert mode.computed is not None


def test_recording_imports_no_compiler():
    """The check runs as a torch function mode: a dispatch mode's first use imports torch._dynamo and sympy
    (~70 MB of RSS, which the quantized checkpoints' RSS bound would pay)."""
    code = ("import sys, torch\nfrom vllmpy.layers.decode_replay import _ViewsOnly\nx = torch.zeros(4)\n"
            "with _ViewsOnly():\n    torch.empty(3), x.view(2, 2), x + 1\n"
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[-2] == "[]", out.stdout


def test_lora_turns_replays_off():
    """Adapters attach as requests name them and follow the runner's per-step mapping, which a replay skips."""
    from vllmpy import LLM

    with_lora = LLM(dtype="float32", num_blocks=16, max_model_len=256, enable_lora=True)
    assert not _replay(with_lora).enabled
