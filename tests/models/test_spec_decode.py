"""Speculative decoding end to end on tiny random models: greedy spec-on gives spec-off's tokens (strict,
or a near-tie of spec-off, DESIGN.md) whatever the drafts, through chunked prefill, prefix-cache hits,
preemption, structured output and every stop; sampled spec-on has spec-off's output distribution.

The proposer is scripted, so both verification paths run: per prompt it drafts the true continuation
(all kept), garbage (all rejected), the truth with one wrong token (partly kept) or nothing, with a
draft length that differs per request.
"""
from __future__ import annotations

import math
from collections import Counter

import pytest

from tests.models.test_batch_invariance import _agree, _record_chunks, _reschedule
from tests.tiny_models import make_tiny_checkpoint

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village",
           "1, 2, 3, 4, 5,", "Alpha beta gamma delta epsilon", "Hi"]
MAX_TOKENS = 14
MAX_MODEL_LEN = 64
K = 4
SPEC = {"method": "ngram", "num_speculative_tokens": K}


class ScriptedProposer:
    """Drafts from each prompt's known continuation (`truths`: prompt ids -> full token ids); prompt i's
    mode is i % 4: truth, garbage, truth with its 2nd draft wrong, nothing; at most 1 + i % K drafts."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.truths: dict[tuple[int, ...], tuple[int, list[int]]] = {}  # prompt -> (index, full ids)
        self.finished: list[str] = []

    def learn(self, outputs) -> None:
        for i, output in enumerate(outputs):
            self.truths[tuple(output.prompt_token_ids)] = (i, output.prompt_token_ids + output.outputs[0].token_ids)

    def propose(self, req_id, token_ids, num_prompt_tokens, k):
        index, truth = self.truths.get(tuple(token_ids[:num_prompt_tokens]), (3, []))
        k = min(k, 1 + index % K)
        n = len(token_ids)
        mode = index % 4
        if mode == 3 or list(token_ids) != truth[:n]:  # off the script: a divergence already happened
            return []
        if mode == 1:
            return [(token_ids[-1] + 7 * (j + 1)) % self.vocab_size for j in range(k)]
        drafts = truth[n:n + k]
        if mode == 2 and len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % self.vocab_size
        return drafts

    def on_request_finished(self, req_id, token_ids, num_prompt_tokens):
        self.finished.append(req_id)


def spec_llm(path: str, monkeypatch, **kwargs):
    """An LLM with speculation on and a ScriptedProposer (returned) in place of n-gram lookup."""
    import vllmpy.spec_decode.drafter as drafter_mod
    from vllmpy import LLM

    holder = {}

    def make(config):
        holder["proposer"] = ScriptedProposer(0)
        return holder["proposer"]

    monkeypatch.setattr(drafter_mod, "make_proposer", make)
    llm = LLM(model=path, dtype="float32", max_model_len=MAX_MODEL_LEN, speculative_config=SPEC, **kwargs)
    holder["proposer"].vocab_size = llm.engine.core.vocab_size
    return llm, holder["proposer"]


def _params(**overrides):
    from vllmpy import SamplingParams

    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 2,
                             **overrides})


def _run(llm, prompts=PROMPTS, **overrides):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in llm.generate(prompts, _params(**overrides), use_tqdm=False)]


def _spec_off(llm, fn):
    """Run fn() with the engine's drafter detached (the same weights, speculation off)."""
    scheduler = llm.engine.core.scheduler
    drafter, scheduler.drafter = scheduler.drafter, None
    try:
        return fn()
    finally:
        scheduler.drafter = drafter


def _respec(llm, **overrides):
    """_reschedule (other limits, same model) keeping the engine's drafter."""
    drafter = llm.engine.core.scheduler.drafter
    scheduler = _reschedule(llm, **overrides)
    scheduler.drafter = drafter
    return scheduler


def _compare(llm, proposer, label: str, prompts=PROMPTS, **overrides) -> None:
    """spec-on vs spec-off on the same scheduler; the proposer scripts from spec-off's outputs."""
    reference = _spec_off(llm, lambda: llm.generate(prompts, _params(**overrides), use_tqdm=False))
    proposer.learn(reference)
    stats = llm.engine.core.scheduler.drafter.stats
    accepted, drafted = stats.num_accepted_tokens, stats.num_draft_tokens
    ours = _run(llm, prompts, **overrides)
    _agree([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in reference], ours, label)
    assert stats.num_draft_tokens > drafted, f"{label}: nothing was drafted"
    assert 0 < stats.num_accepted_tokens - accepted < stats.num_draft_tokens - drafted, \
        f"{label}: drafts were not both kept and rejected"


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"])
def test_greedy_spec_matches_spec_off(arch, smollm2_tokenizer_dir, tmp_path, monkeypatch):
    make_tiny_checkpoint(arch, smollm2_tokenizer_dir, tmp_path)
    llm, proposer = spec_llm(str(tmp_path), monkeypatch, num_blocks=128, block_size=4)
    core = llm.engine.core
    _compare(llm, proposer, f"{arch} mixed batch")
    assert llm.engine.core.scheduler.kv.num_free_blocks == core.num_blocks

    _respec(llm, max_num_batched_tokens=8)
    chunks = _record_chunks(llm)
    _compare(llm, proposer, f"{arch} chunked prefill")
    assert any(c.num_draft_tokens for c in chunks) and any(c.start_pos > 0 and not c.num_draft_tokens
                                                           and len(c.token_ids) > 1 for c in chunks)

    scheduler = _respec(llm, num_blocks=core.kv_cache_config.layout.blocks_per_request(MAX_MODEL_LEN, 8),
                        max_num_batched_tokens=8, enable_prefix_caching=False)
    _compare(llm, proposer, f"{arch} tiny pool")
    assert scheduler.stats().num_preemptions > 0, "the tiny pool caused no preemption"
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_spec_through_prefix_cache_stops_and_grammar(smollm2_tokenizer_dir, tmp_path, monkeypatch):
    """Warm prefix cache, a stop string, a stop token and EOS inside accepted runs, max_tokens reached
    where a run would continue, and structured output: all end exactly where spec-off ends."""
    from vllmpy.sampling_params import StructuredOutputsParams

    make_tiny_checkpoint("LlamaForCausalLM", smollm2_tokenizer_dir, tmp_path)
    llm, proposer = spec_llm(str(tmp_path), monkeypatch, num_blocks=128, block_size=4)
    core, scheduler = llm.engine.core, llm.engine.core.scheduler
    _compare(llm, proposer, "prefix cache, cold")
    hits = scheduler.stats().prefix_cache_hits
    _compare(llm, proposer, "prefix cache, warm")
    assert scheduler.stats().prefix_cache_hits > hits, "the second run did not hit the prefix cache"

    full = _spec_off(llm, lambda: llm.generate(PROMPTS, _params(max_tokens=MAX_TOKENS + 6), use_tqdm=False))
    proposer.learn(full)  # drafts run past every stop below
    tokens = full[0].outputs[0].token_ids
    stop_text = llm.get_tokenizer().decode(tokens[5:7])
    for label, overrides in (("stop string", {"stop": [stop_text]}), ("stop token", {"stop_token_ids": [tokens[6]]}),
                             ("max_tokens mid-run", {"max_tokens": 7})):
        reference = _spec_off(llm, lambda: llm.generate(PROMPTS[:1], _params(**overrides), use_tqdm=False))
        ours = llm.generate(PROMPTS[:1], _params(**overrides), use_tqdm=False)
        assert ours[0].outputs[0].token_ids == reference[0].outputs[0].token_ids, label
        assert ours[0].outputs[0].text == reference[0].outputs[0].text, label
        assert ours[0].outputs[0].finish_reason == reference[0].outputs[0].finish_reason, label
        assert len(ours[0].outputs[0].logprobs) == len(ours[0].outputs[0].token_ids), label
        assert len(ours[0].outputs[0].token_ids) < MAX_TOKENS, label
    eos = tokens[4]
    core.eos_token_ids = {eos}  # what the model's EOS does, at a token the accepted run holds
    reference = _spec_off(llm, lambda: llm.generate(PROMPTS[:1], _params(ignore_eos=False), use_tqdm=False))
    ours = llm.generate(PROMPTS[:1], _params(ignore_eos=False), use_tqdm=False)
    assert ours[0].outputs[0].token_ids == reference[0].outputs[0].token_ids[:5] == tokens[:5]
    assert ours[0].metrics.num_accepted_tokens > 0

    for constraint in (StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{2,6}"),
                       StructuredOutputsParams(choice=["alpha", "beta gamma", "delta"])):
        _compare(llm, proposer, f"grammar {constraint.kind}", PROMPTS[:4], structured_outputs=constraint)
    assert scheduler.kv.num_free_blocks == core.num_blocks


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square with df degrees (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def homogeneity_chi2(a: Counter, b: Counter, min_expected: float = 5.0) -> tuple[float, int]:
    """Two-sample chi-square over the union of outcomes; cells expected below min_expected pooled."""
    na, nb = sum(a.values()), sum(b.values())
    cells, pooled = [], [0, 0]
    for key in set(a) | set(b):
        if (a[key] + b[key]) * min(na, nb) / (na + nb) < min_expected:
            pooled[0] += a[key]
            pooled[1] += b[key]
        else:
            cells.append((a[key], b[key]))
    if sum(pooled):
        cells.append(tuple(pooled))
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(cells) - 1


SMALL_VOCAB = 16


def _small_vocab_llama(vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, bos_token_id=1,
                       eos_token_id=2)


def sampled_outcomes(llm, n: int, **params) -> Counter:
    from vllmpy import SamplingParams

    sp = SamplingParams(n=n, seed=0, max_tokens=4, ignore_eos=True, **params)
    out = llm.generate([{"prompt_token_ids": [3, 5, 7, 3]}], sp, use_tqdm=False)[0]
    return Counter(tuple(c.token_ids[:3]) for c in out.outputs)


class GreedyOrGarbage:
    """Even children draft the likeliest continuation (often kept), odd ones a fixed token (mostly not)."""

    def __init__(self, likely: list[int]) -> None:
        self.likely = likely

    def propose(self, req_id, token_ids, num_prompt_tokens, k):
        done = len(token_ids) - num_prompt_tokens
        if int(req_id.split("_")[0]) % 2:
            return [5] * k
        return self.likely[done:done + k]

    def on_request_finished(self, *args):
        pass


# Strong penalties: a verifier that scored position j without the drafts before it fails (chi2 145 > 129).
SAMPLED = dict(temperature=0.9, top_k=10, top_p=0.95, repetition_penalty=3.0, presence_penalty=1.5,
               logit_bias={5: 1.0})


def test_sampled_spec_keeps_the_distribution(smollm2_tokenizer_dir, tmp_path, monkeypatch):
    """Chi-square (p = 0.001) over the first three tokens of 1,500 seeded requests: spec-on vs spec-off
    with temperature, top-k/p, repetition and presence penalties and a logit bias. A verifier that
    accepts without the p(x) test (chi2 3000 on 47 df), or ignores the draft prefix in penalties, fails it."""
    import vllmpy.spec_decode.drafter as drafter_mod
    from vllmpy import LLM

    make_tiny_checkpoint("LlamaForCausalLM", smollm2_tokenizer_dir, tmp_path, make_config=_small_vocab_llama)
    kwargs = dict(model=str(tmp_path), dtype="float32", max_model_len=32, block_size=4, num_blocks=2048,
                  max_num_seqs=256)
    llm = LLM(**kwargs)
    off = sampled_outcomes(llm, 1500, **SAMPLED)
    likely = list(llm.generate([{"prompt_token_ids": [3, 5, 7, 3]}], _params(max_tokens=4, logprobs=None),
                               use_tqdm=False)[0].outputs[0].token_ids)
    monkeypatch.setattr(drafter_mod, "make_proposer", lambda config: GreedyOrGarbage(likely))
    spec = LLM(**kwargs, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                             "disable_by_batch_size": 256})
    on = sampled_outcomes(spec, 1500, **SAMPLED)
    stats = spec.engine.core.scheduler.drafter.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    stat, df = homogeneity_chi2(off, on)
    print(f"chi2 {stat:.1f} df {df} critical {_chi2_critical(df):.1f}; accepted {stats.num_accepted_tokens}"
          f"/{stats.num_draft_tokens}")
    assert stat < _chi2_critical(df), f"spec-on's distribution differs: chi2 {stat:.1f} on {df} df"


def test_default_model_greedy_spec_matches_spec_off():
    """The default model (Gemma 3 270M) with the real n-gram proposer, a short run: a prompt that repeats
    (drafts kept) and prose (drafts mostly rejected), batched, give spec-off's tokens."""
    from vllmpy import LLM

    llm = LLM(max_model_len=256, num_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    prompts = ["Repeat exactly: red green blue, red green blue, red green blue, red green blue,",
               "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
               "The lighthouse keeper walked along the beach and"]
    params = _params(max_tokens=24)
    reference = _spec_off(llm, lambda: llm.generate(prompts, params, use_tqdm=False))
    ours = _run(llm, prompts, max_tokens=24)
    _agree([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in reference], ours, "default model")
    stats = llm.engine.core.scheduler.drafter.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
