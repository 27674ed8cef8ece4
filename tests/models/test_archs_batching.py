"""Every gated architecture gives the same greedy tokens whether its 4 gate prompts run alone, in one
batch, or in one batch with chunked prefill (max_num_batched_tokens=8: every prompt but the shortest is
split, and decodes run beside prefill chunks). Strict, or a near-tie of the run alone (DESIGN.md)."""
from __future__ import annotations

import pytest

from tests.gate import NEAR_TIE_GAP
from tests.models.test_batch_invariance import _record_chunks, _reschedule
from tests.models.test_gate_transformers import PROMPTS
from tests.tiny_models import ARCHITECTURES, make_tiny_checkpoint

MAX_TOKENS = 16


def _run(llm, prompts):
    from vllmpy import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_agree(reference, other, label: str) -> None:
    for i, ((ref_tokens, ref_lps), (tokens, _)) in enumerate(zip(reference, other)):
        for step, (a, b) in enumerate(zip(ref_tokens, tokens)):
            if a != b:
                top = sorted((lp.logprob for lp in ref_lps[step].values()), reverse=True)
                assert top[0] - top[1] < NEAR_TIE_GAP, f"{label}: prompt {i} step {step}: {a} vs {b}"
                break


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batched_and_chunked_match_alone(arch, smollm2_tokenizer_dir, tmp_path):
    from vllmpy import LLM

    make_tiny_checkpoint(arch, smollm2_tokenizer_dir, tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64, block_size=16, enable_prefix_caching=False)
    alone = [_run(llm, [prompt])[0] for prompt in PROMPTS]
    _assert_agree(alone, _run(llm, PROMPTS), f"{arch} batched")

    _reschedule(llm, enable_prefix_caching=False, max_num_batched_tokens=8)
    chunks = _record_chunks(llm)
    _assert_agree(alone, _run(llm, PROMPTS), f"{arch} chunked")
    assert any(c.start_pos > 0 and len(c.token_ids) > 1 for c in chunks), "no prompt was prefilled in chunks"
    assert any(len(c.token_ids) == 1 for c in chunks[:12]), "no decode ran beside a chunked prefill"
