"""Gate: Qwen2_5_VLForConditionalGeneration and Qwen3VLForConditionalGeneration on tiny random checkpoints
(2-block towers: Qwen2.5-VL windowed with one full block, Qwen3-VL with an interpolated position table and
DeepStack; 2-layer LMs with M-RoPE) against transformers fp32: the processor's pixel values, grids and
token ids on images of several sizes (one smart-resized down), the M-RoPE positions get_rope_index
computes, greedy 32 tokens with logprobs within 1e-3, text-only prompts, and batched / chunked /
prefix-cached runs giving the same tokens as each prompt alone."""
from __future__ import annotations

import numpy as np
import pytest

from tests import vlm_models as vlm
from tests.gate import GateResult, compare, reference_greedy
from vllmpy.multimodal.qwen_vl_processor import merge_block_order

MAX_TOKENS = 32
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
CASES = [(f"{IMAGE}Describe this picture.", [(40, 24, 0)]), (f"What is in {IMAGE}? Answer:", [(100, 60, 1)]),
         (f"Compare {IMAGE} with {IMAGE} in one line.", [(64, 48, 2), (17, 29, 3)])]
GRIDS = [[(6, 10)], [(12, 20)], [(12, 16), (8, 4)]]  # (rows, cols) of patches; 100x60 is shrunk under 4096 px


def _cases():
    return vlm.with_images(CASES)


@pytest.fixture(scope="module", params=vlm.QWEN_VL_FAMILIES)
def qwen_vl(request, smollm2_tokenizer_dir, tmp_path_factory):
    return vlm.build_tiny_vlm(vlm.make_tiny_qwen_vl, smollm2_tokenizer_dir, tmp_path_factory,
                              f"tiny_{request.param.lower()}", request.param)


def _params(max_tokens: int = 12):
    from vllmpy import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def test_processor_matches_transformers(qwen_vl):
    from transformers import AutoImageProcessor

    path, _, processor = qwen_vl
    # the oracle is the image processor transformers builds from the checkpoint's own files
    assert type(AutoImageProcessor.from_pretrained(path)) is type(processor.image_processor)
    llm = vlm.fp32_llm(path)
    for (text, images), grids in zip(_cases(), GRIDS):
        ref, features = vlm.process_like_transformers(llm, processor, text, images)
        assert [f.pixel_values.shape[:3] for f in features] == [(1, r, c) for r, c in grids]
        assert ref["image_grid_thw"].tolist() == [[1, r, c] for r, c in grids]
        pixels = np.concatenate([merge_block_order(f.pixel_values, 2) for f in features])
        assert np.array_equal(pixels, ref["pixel_values"]), text
        assert [f.length for f in features] == [r * c // 4 for r, c in grids] and all(
            f.embed_mask is None for f in features)


def test_mrope_positions_match_get_rope_index(qwen_vl):
    """Prompt positions equal transformers' 3-D rope index; generated positions continue at p + delta."""
    path, model, processor = qwen_vl
    llm = vlm.fp32_llm(path)
    text, images = _cases()[2]
    ref = processor(text=[text], images=[images], return_tensors="pt")
    expected, delta = model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"], ref["image_grid_thw"])
    _, token_ids, features = llm.engine.core.mm_processor.process(vlm.mm_prompt(text, images))
    ours = llm.engine.core.model.mrope_positions(features, 0, len(token_ids) + 3)
    assert np.array_equal(ours[:, :len(token_ids)], expected[:, 0].numpy())
    generated = np.arange(len(token_ids), len(token_ids) + 3) + int(delta)
    assert np.array_equal(ours[:, len(token_ids):], np.stack([generated] * 3))


GATED_ON = {
    "Qwen2_5_VLForConditionalGeneration": "2-block tower (hidden 32) on 4x4 patches merged 2x2, windows of 2x2 merged "
    "patches + 1 full block, images smart-resized within 4096 px, 2-layer Qwen2 LM with M-RoPE (sections 2/3/3)",
    "Qwen3VLForConditionalGeneration": "2-block tower (hidden 32) on 4x4 patches merged 2x2, 8x8 learned positions "
    "interpolated, DeepStack from block 0, images smart-resized within 4096 px, 2-layer Qwen3 LM with interleaved "
    "M-RoPE (4/2/2)",
}


def test_greedy_matches_transformers(qwen_vl, gate_report):
    path, model, processor = qwen_vl
    label = type(model).__name__
    vlm.assert_gate(gate_report, vlm.fp32_llm(path), model, processor, _cases(), MAX_TOKENS, label, GATED_ON[label])


def test_text_only_prompts_match_transformers(qwen_vl):
    path, model, _ = qwen_vl
    result = GateResult()
    llm = vlm.fp32_llm(path)
    for output in llm.generate(["The capital of France is", "def fibonacci(n):"], _params(MAX_TOKENS),
                               use_tqdm=False):
        ref_tokens, ref_logits = reference_greedy(model, output.prompt_token_ids, MAX_TOKENS)
        completion = output.outputs[0]
        logprobs = [pos[t].logprob for pos, t in zip(completion.logprobs, completion.token_ids)]
        compare(result, f"text {output.prompt!r}", completion.token_ids, logprobs, ref_tokens, ref_logits)
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == 2


def test_batch_invariance_with_images(qwen_vl):
    """Alone / batched / chunked across image spans with one image encoded per step / prefix-cached with
    the same image give the same tokens; a different image of the same size does not hit its blocks."""
    path = qwen_vl[0]
    prompts = [vlm.mm_prompt(text, images) for text, images in _cases()] + [{"prompt": "Plain text too."}]
    vlm.agree_batched_and_chunked(lambda **kw: vlm.fp32_llm(path, **kw), prompts,
                                  {"max_num_batched_tokens": 9, "max_num_encoder_input_tokens": 60},
                                  "chunks of 9 across image spans, one image encoded per step")
    from tests.models.test_batch_invariance import _agree

    cached_llm = vlm.fp32_llm(path, block_size=8, num_blocks=128)
    first = cached_llm.generate(prompts[:1], _params(), use_tqdm=False)[0]
    again = cached_llm.generate(prompts[:1], _params(), use_tqdm=False)[0]
    span = cached_llm.engine.core.mm_processor.process(prompts[0])[2][0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= span.end
    pair = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in (first, again)]
    _agree(pair[:1], pair[1:], "prefix-cached")
    other = cached_llm.generate([vlm.mm_prompt(CASES[0][0], [vlm.sample_image(40, 24, 99)])], _params(),
                                use_tqdm=False)[0]
    assert other.num_cached_tokens <= span.offset // 8 * 8, "a different image hit the first image's blocks"


def test_chat_prompt_matches_transformers(qwen_vl):
    """LLM.chat with an image part renders as the processor's chat template does, then expands alike; a
    template that takes string content gets vLLM's `<|vision_start|><|image_pad|><|vision_end|>` per image."""
    path, _, processor = qwen_vl
    llm = vlm.fp32_llm(path)
    image = vlm.sample_image(40, 24, 0)
    text = [{"type": "text", "text": "Describe"}, {"type": "text", "text": " it."}]
    messages = [{"role": "user", "content": [text[0], {"type": "image_pil", "image_pil": image}, text[1]]}]
    ours = llm.chat(messages, _params(1), use_tqdm=False)[0]
    rendered = processor.apply_chat_template(
        [{"role": "user", "content": [text[0], {"type": "image"}, text[1]]}], add_generation_prompt=True,
        tokenize=False)
    assert ours.prompt_token_ids == processor(text=[rendered], images=[[image]])["input_ids"][0]
    plain = llm.chat(messages, _params(1), use_tqdm=False,
                     chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")[0]
    assert plain.prompt_token_ids == processor(text=[f"Describe\n{IMAGE}\n it."], images=[[image]])["input_ids"][0]
