"""Gate: Qwen3_5ForConditionalGeneration and Qwen3_5MoeForConditionalGeneration on tiny random checkpoints
(the Qwen3-VL tower, 2 blocks, without DeepStack; a 4-layer hybrid LM: 3 Gated DeltaNet + 1 gated
attention with interleaved M-RoPE over its partial rotary) against transformers fp32, through the Qwen-VL
gate's own checks (tests/models/test_vlm_qwen.py): processor pixel values, grids and token ids, M-RoPE
positions against get_rope_index, greedy 32 tokens with logprobs within 1e-3 on 2 one-image prompts and a
two-image prompt of different sizes, text-only prompts; on the dense model alone / batched / chunked across
image spans (the recurrent state carried through a span split over steps) / prefix-cached at a
recurrent-state snapshot past the image."""
from __future__ import annotations

import pytest

from tests import vlm_models as vlm
from tests.models import test_vlm_qwen as qwen_vl_gate

GATED_ON = {
    "Qwen3_5ForConditionalGeneration": "Qwen3-VL tower without DeepStack (2 blocks, hidden 32, 8x8 learned "
    "positions interpolated) on 4x4 patches merged 2x2; 4-layer LM 3 GDN + 1 gated attention, interleaved "
    "M-RoPE 3/3/2 over partial rotary 0.25",
    "Qwen3_5MoeForConditionalGeneration": "the Qwen3.5 tower and layer pattern, every layer 4 experts top-2 + "
    "sigmoid-gated shared expert",
}


@pytest.fixture(scope="module", params=vlm.QWEN3_5_FAMILIES)
def qwen3_5(request, smollm2_tokenizer_dir, tmp_path_factory):
    return vlm.build_tiny_vlm(vlm.make_tiny_qwen_vl, smollm2_tokenizer_dir, tmp_path_factory,
                              f"tiny_{request.param.lower()}", request.param)


def test_processor_and_positions_match_transformers(qwen3_5):
    qwen_vl_gate.test_processor_matches_transformers(qwen3_5)
    qwen_vl_gate.test_mrope_positions_match_get_rope_index(qwen3_5)


def test_greedy_matches_transformers(qwen3_5, gate_report):
    path, model, processor = qwen3_5
    label = type(model).__name__
    vlm.assert_gate(gate_report, vlm.fp32_llm(path), model, processor, qwen_vl_gate._cases(),
                    qwen_vl_gate.MAX_TOKENS, label, GATED_ON[label])


def test_text_only_prompts_match_transformers(qwen3_5):
    qwen_vl_gate.test_text_only_prompts_match_transformers(qwen3_5)


# Over 128 tokens with its image in the first 64: two recurrent-state snapshots (one per 64 prompt tokens).
LONG_PROMPT = f"{qwen_vl_gate.IMAGE}Describe this picture. " + " ".join(f"item {i} is here." for i in range(12))


@pytest.mark.parametrize("qwen3_5", ["Qwen3_5"], indirect=True)  # the MoE model shares every image code path
def test_batch_invariance_with_images(qwen3_5):
    """Alone / batched / chunked across image spans (the Qwen-VL gate's prompts and chunks of 9: the GDN
    state carried through a span split over steps), then prefix-cached: a hybrid resumes only at a snapshot
    of its recurrent state, so the long prompt hits 128 tokens (past its image) and continues alike; a
    different image of the same size hits nothing."""
    from tests.models.test_batch_invariance import _agree

    path = qwen3_5[0]
    prompts = [vlm.mm_prompt(text, images) for text, images in qwen_vl_gate._cases()] + [{"prompt": "Plain text too."}]
    vlm.agree_batched_and_chunked(lambda **kw: vlm.fp32_llm(path, **kw), prompts,
                                  {"max_num_batched_tokens": 9, "max_num_encoder_input_tokens": 60},
                                  "chunks of 9 across image spans, one image encoded per step")
    llm = vlm.fp32_llm(path, block_size=8, num_blocks=128, max_num_seqs=4, recurrent_snapshot_fraction=0.5)
    prompt = vlm.mm_prompt(LONG_PROMPT, [vlm.sample_image(100, 60, 1)])
    first, again = (llm.generate([prompt], qwen_vl_gate._params(), use_tqdm=False)[0] for _ in range(2))
    span = llm.engine.core.mm_processor.process(prompt)[2][0]
    assert span.end <= 64 < 128 < len(first.prompt_token_ids)
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 128)
    _agree([(first.outputs[0].token_ids, first.outputs[0].logprobs)],
           [(again.outputs[0].token_ids, again.outputs[0].logprobs)], "prefix-cached")
    other = llm.generate([vlm.mm_prompt(LONG_PROMPT, [vlm.sample_image(100, 60, 99)])], qwen_vl_gate._params(),
                         use_tqdm=False)[0]
    assert other.num_cached_tokens == 0, "a different image hit the first image's snapshot"
