"""Batch invariance: the same greedy tokens whether prompts run alone, together, chunked, from a warm
prefix cache, under preemption, or arriving while others decode (strict, or near-tie as DESIGN.md)."""
from __future__ import annotations

import pytest

from tests.gate import NEAR_TIE_GAP
from tests.tiny_models import make_tiny_checkpoint

SHARED = ("You are a careful assistant. Answer briefly and precisely, and never make up facts. "
          "Here is the question: ")
PROMPTS = [SHARED + q for q in ("What is the capital of France?", "Name a prime number.", "Why is the sky blue?",
                                "What is 2 + 2?")] + [
    "Hi", "The quick brown fox", "In 1492,", "def main():\n    print(",
    "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20", "Paris is", "Once upon a time"]
MAX_TOKENS = 12
MAX_MODEL_LEN = 256
# Tiny configs with windows of 8 (16 for Phi-3) under prompts of ~30 tokens: the window matters and
# sliding groups return blocks as they go (with 4-token blocks a window spans several of them).
SLIDING_ARCHS = ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "MistralForCausalLM", "Cohere2ForCausalLM",
                 "Phi3ForCausalLM"]


def _params():
    from vllmpy import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def _outputs(llm, prompts=PROMPTS):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, _params(), use_tqdm=False)]


def _agree(reference, other, label: str, gap_bound: float = NEAR_TIE_GAP) -> int:
    """Count strict matches; a divergence must be a near-tie of the reference (top-2 gap under gap_bound).
    Returns near-ties."""
    near = 0
    for i, ((ref_tokens, ref_lps), (tokens, _)) in enumerate(zip(reference, other)):
        for step, (a, b) in enumerate(zip(ref_tokens, tokens)):
            if a != b:
                top = sorted((lp.logprob for lp in ref_lps[step].values()), reverse=True)
                gap = top[0] - top[1]
                assert gap < gap_bound, f"{label}: prompt {i} step {step}: {a} vs {b}, top-2 gap {gap:.2e}"
                near += 1
                break
    print(f"{label}: strict={len(reference) - near} near_tie={near}")
    return near


def _reschedule(llm, **overrides):
    """Swap in a scheduler with other limits over the same loaded model (no reload); num_blocks may
    only shrink the pool the runner allocated."""
    from dataclasses import replace

    from vllmpy.engine.scheduler import Scheduler

    core = llm.engine.core
    cache = replace(core.config.cache, **{k: v for k, v in overrides.items() if k in ("enable_prefix_caching",)})
    sched = replace(core.config.scheduler, **{k: v for k, v in overrides.items() if k in ("max_num_batched_tokens", "max_num_seqs")})
    kv = replace(core.kv_cache_config, num_blocks=overrides.get("num_blocks", core.num_blocks))
    core.scheduler = Scheduler(sched, cache, kv, core.max_model_len)
    return core.scheduler


def _record_chunks(llm) -> list:
    chunks = []
    runner = llm.engine.core.runner
    original = runner.execute

    def execute(so):
        chunks.extend(so.chunks)
        return original(so)

    runner.execute = execute
    return chunks


def _check_batched_and_chunked(llm, one_at_a_time, budget: int, gap_bound: float = NEAR_TIE_GAP) -> None:
    """(b) all prompts in one batch, (c) prompts prefilled in chunks of `budget` tokens beside decodes."""
    _reschedule(llm, enable_prefix_caching=False)
    _agree(one_at_a_time, _outputs(llm), "(b) all together", gap_bound)

    _reschedule(llm, enable_prefix_caching=False, max_num_batched_tokens=budget)
    chunks = _record_chunks(llm)
    _agree(one_at_a_time, _outputs(llm), f"(c) max_num_batched_tokens={budget}", gap_bound)
    assert any(c.start_pos > 0 and len(c.token_ids) > 1 for c in chunks), "no prompt was prefilled in chunks"
    assert any(len(c.token_ids) == 1 for c in chunks[:40]), "no decode ran beside a chunked prefill"


def _check_invariance(llm, gap_bound: float = NEAR_TIE_GAP) -> None:
    one_at_a_time = [_outputs(llm, [p])[0] for p in PROMPTS]  # (a)
    _check_batched_and_chunked(llm, one_at_a_time, 16, gap_bound)

    scheduler = _reschedule(llm, enable_prefix_caching=True)
    _agree(one_at_a_time, _outputs(llm), "(d) prefix cache, cold", gap_bound)
    hits_before = scheduler.stats().prefix_cache_hits
    _agree(one_at_a_time, _outputs(llm), "(d) prefix cache, warm", gap_bound)
    assert scheduler.stats().prefix_cache_hits > hits_before, "the second run did not hit the prefix cache"

    # The smallest pool that holds one full-length sequence; where a window's share shrinks with the
    # chunk, 16-token chunks keep it small so that the pool is tight.
    core = llm.engine.core
    layout, default_chunk = core.kv_cache_config.layout, core.config.scheduler.max_num_batched_tokens
    chunk = min((default_chunk, 16), key=lambda c: layout.blocks_per_request(MAX_MODEL_LEN, c))
    scheduler = _reschedule(llm, num_blocks=layout.blocks_per_request(MAX_MODEL_LEN, chunk),
                            enable_prefix_caching=False, max_num_batched_tokens=chunk)
    _agree(one_at_a_time, _outputs(llm), "(e) tiny pool", gap_bound)
    assert scheduler.stats().num_preemptions > 0, "the tiny pool caused no preemption"
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks

    _reschedule(llm)
    engine = llm.engine
    results = {}
    for i, prompt in enumerate(PROMPTS[:6]):
        engine.add_request(f"f{i}", prompt, _params())
    for _ in range(3):
        results.update({o.request_id: o for o in engine.step() if o.finished})
    for i, prompt in enumerate(PROMPTS[6:], start=6):  # arrive while the first six decode
        engine.add_request(f"f{i}", prompt, _params())
    while engine.has_unfinished_requests():
        results.update({o.request_id: o for o in engine.step() if o.finished})
    late = [(results[f"f{i}"].outputs[0].token_ids, None) for i in range(len(PROMPTS))]
    _agree(one_at_a_time, late, "(f) arriving while others decode", gap_bound)


def test_batch_invariance_tiny_model(smollm2_tokenizer_dir, tmp_path):
    from vllmpy import LLM

    make_tiny_checkpoint("LlamaForCausalLM", smollm2_tokenizer_dir, tmp_path)
    _check_invariance(LLM(model=str(tmp_path), dtype="float32", max_model_len=MAX_MODEL_LEN, num_blocks=256))


def _check_window_reclaimed(llm) -> None:
    """While a long prompt decodes, each sliding group holds only its window's blocks; then all return."""
    from vllmpy.engine.kv_cache_managers import SlidingWindowManager

    engine, kv, core = llm.engine, llm.engine.core.scheduler.kv, llm.engine.core
    sliding = [m for m in kv.managers if isinstance(m, SlidingWindowManager)]
    assert sliding, "no sliding-window group"
    # The groups' layers share the pool's bytes: what is allocated is what sizing counted.
    assert core.runner.kv_cache_bytes == core.num_blocks * core.kv_cache_config.layout.block_bytes
    engine.add_request("long", PROMPTS[0], _params())
    for _ in range(4):
        engine.step()
    for manager in sliding:
        table = manager.tables["long"]
        held = [block for block in table if block is not None]
        assert None in table and len(held) <= -(-manager.window // manager.block_size) + 1, table
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("arch", SLIDING_ARCHS)
def test_batch_invariance_sliding_window(arch, smollm2_tokenizer_dir, tmp_path):
    from vllmpy import LLM

    make_tiny_checkpoint(arch, smollm2_tokenizer_dir, tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=MAX_MODEL_LEN, num_blocks=512, block_size=4)
    _check_invariance(llm)
    _check_window_reclaimed(llm)


# The default model's packed weights: a row computed alone and in a batch of 4-32 rows take different
# kernels (the small-batch kernel rounds activations to int16 per 32-block), which moves its logits by up to
# ~1e-3 (measured: 9e-4 in a SmolLM2 GGUF logprob); a divergence at a top-2 gap under that is a near-tie, not a bug.
PACKED_NEAR_TIE_GAP = 1e-3


def test_batch_invariance_default_model():
    from vllmpy import LLM

    _check_invariance(LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, num_blocks=256), PACKED_NEAR_TIE_GAP)
