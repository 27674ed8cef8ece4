"""Prefix caching and speculative decoding on hybrid recurrent models, one tiny config per mixer kind:
Granite 4.0-H (Mamba2), Qwen3.5 (Gated DeltaNet), LFM2 (short conv).

Prefix caching: a repeated prompt and one sharing a 64+-token prefix resume from recurrent-state
snapshots (the hit count must grow) and give the tokens of a run without the cache; a prompt cut
mid-way resumes from the snapshot boundary before the cut; preemption and abort give every seat,
block and snapshot slot back. Speculation: n-gram drafts on repetitive prompts give
spec-off's greedy tokens, and so do scripted drafts kept to every position (the seat is left at the
last accepted draft's state)."""
from __future__ import annotations

import pytest

from tests.models.test_batch_invariance import _agree, _reschedule
from tests.models.test_hybrid_gdn import lfm2, qwen3_5
from tests.models.test_hybrid_mamba import _preempt_during, granite_hybrid
from tests.models.test_spec_decode import ScriptedProposer
from tests.tiny_models import make_tiny_checkpoint

MAX_MODEL_LEN = 256
MAX_TOKENS = 10
MODELS = {"GraniteMoeHybridForCausalLM": granite_hybrid, "Qwen3_5ForCausalLM": qwen3_5, "Lfm2ForCausalLM": lfm2}
# ~140 tokens: two snapshot boundaries (64, 128) inside the shared part of the prompts below
SHARED = " ".join(f"Item {i}: the {w} sat near the {v}." for i, (w, v) in
                  enumerate(zip("cat dog owl fox elk yak ant bee".split() * 2, "door wall lamp tree bed".split() * 4)))
SPEC_PROMPTS = ["one two three four five one two three four five one two three four five one two",
                "a b a b a b a b a b", "Alpha beta gamma delta epsilon alpha beta gamma", "1, 2, 3, 1, 2, 3, 1, 2,"]


class WrongAt(ScriptedProposer):
    """Drafts spec-off's own continuation with prompt i's i-th draft wrong (none for i >= k), so the verifier
    keeps 0, 1, 2, ... k drafts: the seat is committed at every position of a verification row."""

    def propose(self, req_id, token_ids, num_prompt_tokens, k):
        index, truth = self.truths[tuple(token_ids[:num_prompt_tokens])]
        if list(token_ids) != truth[:len(token_ids)]:
            return []
        drafts = truth[len(token_ids):len(token_ids) + k]
        if index < len(drafts):
            drafts[index] = (drafts[index] + 1) % self.vocab_size
        return drafts


def _params(**overrides):
    from vllmpy import SamplingParams

    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 2,
                             **overrides})


def _run(llm, prompts) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, _params(), use_tqdm=False)]


def _cached(llm, prompt) -> tuple[tuple[list[int], list], int]:
    """One prompt's (tokens, logprobs) and the prompt tokens it took from the prefix cache."""
    (output,) = llm.generate([prompt], _params(), use_tqdm=False)
    return (output.outputs[0].token_ids, output.outputs[0].logprobs), output.num_cached_tokens


def _assert_idle(scheduler) -> None:
    kv = scheduler.kv
    assert kv.seats.num_free == kv.seats.num_seats, "a seat leaked"
    assert kv.num_free_blocks == kv.num_blocks, "a block leaked"
    assert kv.snapshots.num_reserved == 0, "a snapshot slot leaked"


@pytest.fixture(scope="module", params=list(MODELS))
def hybrid(request, smollm2_tokenizer_dir, tmp_path_factory):
    """(arch, LLM with prefix caching on, its n-gram drafter, the shared prompt's token ids). Each test
    swaps in its own scheduler over the loaded model (_reschedule) and attaches the drafter where it drafts."""
    from vllmpy import LLM

    out = tmp_path_factory.mktemp(request.param)
    make_tiny_checkpoint(request.param, smollm2_tokenizer_dir, out, MODELS[request.param])
    # half the pool for snapshots: a dozen or more, whichever the family's state size
    llm = LLM(model=str(out), dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=16, num_blocks=256,
              max_num_seqs=4, recurrent_snapshot_fraction=0.5,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    return request.param, llm, llm.engine.core.scheduler.drafter, llm.get_tokenizer().encode(SHARED)


def _without_cache_or_drafts(llm, prompts):
    """Each prompt alone, no prefix cache and no speculation: the reference tokens."""
    _reschedule(llm, enable_prefix_caching=False)
    return [_run(llm, [p])[0] for p in prompts]


def test_prefix_hits_resume_from_snapshots(hybrid):
    arch, llm, _, shared_ids = hybrid
    assert 128 < len(shared_ids) < MAX_MODEL_LEN - 2 * MAX_TOKENS
    first = {"prompt_token_ids": shared_ids + llm.get_tokenizer().encode(" Which animal sat near the lamp?")}
    sibling = {"prompt_token_ids": shared_ids[:100] + llm.get_tokenizer().encode(" Count the birds.")}
    cut = {"prompt_token_ids": first["prompt_token_ids"][:120] + [17, 23, 31]}  # past the 64 boundary, short of 128
    reference = _without_cache_or_drafts(llm, [first, sibling, cut])

    scheduler = _reschedule(llm)  # prefix caching on, a fresh cache; no drafter
    assert scheduler.kv.snapshots.num_slots >= 8
    cold, cold_hit = _cached(llm, first)
    warm, warm_hit = _cached(llm, first)
    assert cold_hit == 0 and scheduler.stats().recurrent_snapshot_hits == 1
    # the longest boundary of the prompt that leaves its last token to compute: 128 of its ~150 tokens
    assert warm_hit == 128, f"{arch}: the repeat resumed {warm_hit} tokens"
    near, near_hit = _cached(llm, sibling)
    assert near_hit == 64, f"{arch}: a 100-token shared prefix resumed {near_hit} tokens"
    cut_out, cut_hit = _cached(llm, cut)
    assert cut_hit == 64, f"{arch}: a prompt cut at 120 tokens resumed {cut_hit} tokens"
    stats = llm.engine.stats()
    assert stats.recurrent_snapshot_hits == 3
    assert stats.recurrent_snapshot_bytes == 2 * llm.engine.core.kv_cache_config.layout.state_bytes_per_seq  # 64, 128
    _agree(reference, [cold, near, cut_out], f"{arch}: cold / shared prefix / cut")
    _agree(reference[:1], [warm], f"{arch}: warm repeat")
    _assert_idle(scheduler)


def test_preemption_and_abort_return_every_snapshot(hybrid):
    arch, llm, _, shared_ids = hybrid
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": shared_ids[:40 + 20 * i] + tokenizer.encode(f" Question {i}?")} for i in range(4)]
    reference = _without_cache_or_drafts(llm, prompts)
    scheduler = _reschedule(llm, max_num_batched_tokens=48)  # prefills cross boundaries over several steps
    _preempt_during(llm, scheduler)
    _agree(reference, _run(llm, prompts), f"{arch}: preempted with prefix caching")
    assert scheduler.stats().num_preemptions > 0
    _assert_idle(scheduler)

    engine = llm.engine
    for i, prompt in enumerate(prompts):  # new prefixes: their boundaries are reserved afresh
        engine.add_request(f"abort{i}", {"prompt_token_ids": [7] + prompt["prompt_token_ids"]}, _params())
    for _ in range(3):
        engine.step()
    assert scheduler.running, "nothing was running to abort"
    engine.abort_request([f"abort{i}" for i in range(len(prompts))])
    _assert_idle(scheduler)


def test_speculation_matches_spec_off(hybrid):
    """n-gram drafts (a random model seldom follows them: few, nearly all rejected), then WrongAt's."""
    from vllmpy.spec_decode.drafter import Drafter

    arch, llm, drafter, _ = hybrid
    _reschedule(llm, enable_prefix_caching=False)
    outputs = [llm.generate([p], _params(max_tokens=16), use_tqdm=False)[0] for p in SPEC_PROMPTS]
    reference = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    scripted = WrongAt(llm.engine.core.vocab_size)
    scripted.learn(outputs)
    for label, proposer in (("ngram", drafter.proposer), ("scripted", scripted)):
        scheduler = _reschedule(llm)  # prefix caching on as well
        scheduler.drafter = Drafter(drafter.config, proposer)
        ours = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                for o in llm.generate(SPEC_PROMPTS, _params(max_tokens=16), use_tqdm=False)]
        _agree(reference, ours, f"{arch}: {label} spec-on vs spec-off")
        _assert_idle(scheduler)
    stats = scheduler.drafter.stats  # the scripted run's
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, \
        f"{arch}: {stats.num_accepted_tokens} of {stats.num_draft_tokens} drafts kept: not partly rejected"
    assert all(stats.accepted_per_pos), f"{arch}: some draft position was never accepted: {stats.accepted_per_pos}"
