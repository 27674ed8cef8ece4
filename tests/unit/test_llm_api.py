"""The offline API end to end on a tiny checkpoint: vLLM's fields, stops, seeds, n, chat, dtypes."""
from __future__ import annotations

import pytest

from vllmpy import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    from vllmpy import LLM
    return LLM(model=tiny_llama_dir, num_blocks=128, max_model_len=256)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def test_request_output_fields(llm):
    out = llm.generate("Hello", _greedy(max_tokens=5, logprobs=3), use_tqdm=False)[0]
    assert out.prompt == "Hello" and out.prompt_token_ids == llm.get_tokenizer().encode("Hello")
    assert out.finished and out.prompt_logprobs is None
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5 and len(c.logprobs) == 5
    assert c.text == llm.get_tokenizer().decode(c.token_ids)
    assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for p, t in zip(c.logprobs, c.token_ids)))
    for position, token in zip(c.logprobs, c.token_ids):
        # Greedy: the chosen token is the top-1, so the entry is exactly the top-3 with ranks 1..3.
        assert len(position) == 3 and position[token].rank == 1
        assert sorted(lp.rank for lp in position.values()) == [1, 2, 3]
        assert position[token].logprob == max(lp.logprob for lp in position.values())


def test_stop_string_is_excluded_and_reported(llm):
    free = llm.generate("Once upon", _greedy(max_tokens=20), use_tqdm=False)[0].outputs[0].text
    stop = free[len(free) // 2: len(free) // 2 + 3]
    assert stop.strip(), "need a non-blank stop string from the free-running text"
    out = llm.generate("Once upon", _greedy(max_tokens=20, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free[:free.index(stop)]
    kept = llm.generate("Once upon", _greedy(max_tokens=20, stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == free[:free.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    free = llm.generate("Once upon", _greedy(max_tokens=12), use_tqdm=False)[0].outputs[0].token_ids
    target = free[4]
    out = llm.generate("Once upon", _greedy(max_tokens=12, stop_token_ids=[target]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.token_ids == free[:free.index(target) + 1]
    late = llm.generate("Once upon", _greedy(max_tokens=12, stop_token_ids=[target], min_tokens=10),
                        use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= 10


def test_seeded_sampling_is_independent_of_batch_company(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate("The weather", seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(["Something else", "The weather", "More company here"],
                         [SamplingParams(temperature=0.9, max_tokens=16), seeded, _greedy(max_tokens=16)],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_n_gives_distinct_indexed_samples(llm):
    out = llm.generate("The weather", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_invalid_params_name_the_field():
    for kwargs, field in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n"),
                          ({"max_tokens": 0}, "max_tokens"), ({"prompt_logprobs": -2}, "prompt_logprobs"),
                          ({"min_p": 2}, "min_p")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_prompt_too_long_is_refused(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(1, 300))], _greedy(max_tokens=2), use_tqdm=False)


def test_max_tokens_none_runs_to_max_model_len(llm):
    out = llm.generate([list(range(1, 240))], _greedy(max_tokens=None), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 256
    assert out.outputs[0].finish_reason == "length"


def test_chat_renders_the_checkpoint_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = llm.chat(messages, _greedy(max_tokens=4), use_tqdm=False)[0]
    rendered = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    assert out.prompt == rendered and "<|im_start|>assistant" in rendered
    assert out.prompt_token_ids == llm.get_tokenizer().encode(rendered, add_special_tokens=False)


def test_bfloat16_runs_on_cpu(tiny_llama_dir):
    from vllmpy import LLM

    llm = LLM(model=tiny_llama_dir, dtype="bfloat16", num_blocks=32, max_model_len=256)
    assert llm.engine.core.dtype.__repr__() == "torch.bfloat16"
    assert len(llm.generate("Hi", _greedy(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_unavailable_device_is_refused(tiny_llama_dir):
    import torch

    from vllmpy import LLM

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the refusal is for machines without it")
    with pytest.raises(ValueError, match="--device cuda"):
        LLM(model=tiny_llama_dir, device="cuda")
