"""Custom logits processors: per-request callables and engine-level batch processors change what is
sampled as specified, fail only their own requests, and compose with a grammar (processors, then mask)."""
from __future__ import annotations

import pytest
import torch

from vllmpy import LLM, SamplingParams
from vllmpy.sampling.logits_processors import LogitsProcessor
from vllmpy.sampling_params import StructuredOutputsParams

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(model=tiny_llama_dir, num_blocks=256, max_num_seqs=64)


def _ban(banned: set[int]):
    ids = torch.tensor(sorted(banned))

    def processor(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill(0, ids, float("-inf"))
    return processor


def _allow_only(allowed: list[int]):
    def processor(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        kept = torch.full_like(logits, float("-inf"))
        kept[allowed] = logits[allowed]
        return kept
    return processor


def _greedy(llm: LLM, **kw) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kw)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


def test_request_processor_bans_tokens(llm):
    free = _greedy(llm)
    banned = _greedy(llm, logits_processors=[_ban(set(free))])
    assert banned != free and not set(banned) & set(free)


def test_request_processor_limits_sampled_tokens(llm):
    digits = [llm.get_tokenizer().encode(str(d), add_special_tokens=False)[0] for d in range(10)]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=10, ignore_eos=True,
                             logits_processors=[_allow_only(digits)]) for s in range(20)]
    for out in llm.generate([PROMPT] * 20, params, use_tqdm=False):
        assert set(out.outputs[0].token_ids) <= set(digits) and out.outputs[0].text.isdigit()


def test_three_argument_processor_sees_the_prompt(llm):
    seen = []

    def processor(prompt_token_ids: list[int], output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append((prompt_token_ids, len(output_token_ids)))
        return logits
    assert _greedy(llm, logits_processors=[processor]) == _greedy(llm)
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    assert seen == [(prompt_ids, i) for i in range(12)]


def test_request_processor_composes_with_grammar(llm):
    no = llm.get_tokenizer().encode("no", add_special_tokens=False)
    assert len(no) == 1
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, logits_processors=[_allow_only(no)],
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"])) for s in range(20)]
    outs = llm.generate([PROMPT] * 20, params, use_tqdm=False)
    assert all(o.outputs[0].text == "no" and o.outputs[0].finish_reason == "stop" for o in outs)


def test_failing_processor_fails_only_its_request(llm):
    def broken(output_token_ids, logits):
        raise RuntimeError("boom")
    bad, good = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0.0, logits_processors=[broken]),
                                                SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)],
                             use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and "boom" in bad.error
    assert good.outputs[0].token_ids == _greedy(llm)


def test_processors_are_validated():
    with pytest.raises(ValueError, match="logits_processors must be a list of callables"):
        SamplingParams(logits_processors=[42])


class BanFromExtraArgs(LogitsProcessor):
    """Engine-level: each row may list token ids to ban in `extra_args["ban"]` (or allow, `["allow"]`)."""

    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        for i, row in enumerate(rows):
            if "ban" in row.params.extra_args:
                logits[i, row.params.extra_args["ban"]] = float("-inf")
            if "allow" in row.params.extra_args:
                allowed = row.params.extra_args["allow"]
                kept = logits[i, allowed].clone()
                logits[i] = float("-inf")
                logits[i, allowed] = kept
        return logits


@pytest.fixture(scope="module")
def batch_llm(tiny_llama_dir) -> LLM:
    return LLM(model=tiny_llama_dir, num_blocks=256, logits_processors=[BanFromExtraArgs])


def test_batch_processor_bans_per_row(llm, batch_llm):
    free = _greedy(llm)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    banned, untouched = batch_llm.generate(
        [PROMPT, PROMPT], [params.clone(extra_args={"ban": sorted(set(free))}), params], use_tqdm=False)
    assert not set(banned.outputs[0].token_ids) & set(free)
    assert untouched.outputs[0].token_ids == free


def test_batch_processor_composes_with_grammar(batch_llm):
    yes = batch_llm.get_tokenizer().encode("yes", add_special_tokens=False)
    assert len(yes) == 1
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, extra_args={"allow": yes},
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"])) for s in range(20)]
    outs = batch_llm.generate([PROMPT] * 20, params, use_tqdm=False)
    assert all(o.outputs[0].text == "yes" and o.outputs[0].finish_reason == "stop" for o in outs)


def test_engine_processor_without_apply_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="has no apply"):
        LLM(model=tiny_llama_dir, num_blocks=64, logits_processors=[object()])
