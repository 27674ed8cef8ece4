"""Gate: Gemma3ForConditionalGeneration on a tiny random checkpoint (SigLIP tower + average-pool projector
+ LM with bidirectional attention over each image) against transformers fp32: the processor's pixel values
and token ids, greedy 32 tokens with logprobs within 1e-3, batch invariance with images, text-only use."""
from __future__ import annotations

import numpy as np
import pytest

from tests.gate import GateResult, compare, reference_greedy
from tests.models.test_batch_invariance import _agree
from tests.vlm_models import GEMMA3_IMAGE_TOKENS, gate_vlm, make_tiny_gemma3_vlm, mm_prompt, sample_image

MAX_TOKENS = 32
# Two prompts with one image, one with two images of different sizes (every image is resized to 32x32).
CASES = [("<start_of_image>Describe this picture.", [(40, 24, 0)]),
         ("What colour is the thing in <start_of_image>? Answer:", [(20, 36, 1)]),
         ("Compare <start_of_image> with <start_of_image> in one line.", [(64, 48, 2), (17, 29, 3)])]


@pytest.fixture(scope="module")
def vlm(smollm2_tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_gemma3_vlm")
    model, processor = make_tiny_gemma3_vlm(smollm2_tokenizer_dir, out)
    return str(out), model, processor


def _case_inputs(case):
    text, sizes = case
    return text, [sample_image(*size) for size in sizes]


def _params(max_tokens=MAX_TOKENS):
    from vllmpy import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def _llm(path, **kwargs):
    from vllmpy import LLM
    return LLM(model=path, dtype="float32", **{"num_blocks": 96, "block_size": 16, **kwargs})


def _outputs(llm, prompts):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, _params(), use_tqdm=False)]


def test_processor_matches_transformers(vlm):
    from vllmpy.multimodal.image_processor import ImageProcessor

    path, _, processor = vlm
    ours = ImageProcessor.from_pretrained(path)
    llm = _llm(path)
    for case in CASES:
        text, images = _case_inputs(case)
        ref = processor(text=[text], images=[images], return_tensors="np")
        pixels = np.stack([ours(image) for image in images])
        assert pixels.dtype == np.float32 and np.array_equal(pixels, ref["pixel_values"]), text
        _, token_ids, features = llm.engine.core.mm_processor.process(mm_prompt(text, images))
        assert token_ids == ref["input_ids"][0].tolist(), text
        assert [f.length for f in features] == [GEMMA3_IMAGE_TOKENS] * len(images)
        token_types = np.zeros(len(token_ids), dtype=np.int64)
        for f in features:
            token_types[f.offset:f.end] = 1
        assert np.array_equal(token_types, ref["token_type_ids"][0])


def test_greedy_matches_transformers(vlm, gate_report):
    path, model, processor = vlm
    result = gate_vlm(_llm(path), model, processor, [_case_inputs(case) for case in CASES], MAX_TOKENS,
                      "Gemma3ForConditionalGeneration")
    gate_report("Gemma3ForConditionalGeneration", result,
                "SigLIP 2 layers on 32x32, 16 soft tokens per image, bidirectional image spans, sliding 8", len(CASES))
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == len(CASES)


def test_text_only_prompts_on_the_checkpoint(vlm):
    path, model, _ = vlm
    llm = _llm(path)
    result = GateResult()
    for output in llm.generate(["The capital of France is", "def fibonacci(n):"], _params(), use_tqdm=False):
        ref_tokens, ref_logits = reference_greedy(model, output.prompt_token_ids, MAX_TOKENS)
        completion = output.outputs[0]
        logprobs = [pos[t].logprob for pos, t in zip(completion.logprobs, completion.token_ids)]
        compare(result, f"text {output.prompt!r}", completion.token_ids, logprobs, ref_tokens, ref_logits)
    assert not result.failures, "\n".join(result.failures)


def test_batch_invariance_with_images(vlm):
    """Alone / batched / chunked up to each image (its span is never split) / prefix-cached with 8-token
    blocks (a hit may end inside an image's span) give the same tokens; a different image of the same
    size misses from the first block it covers."""
    path, _, _ = vlm
    prompts = [mm_prompt(*_case_inputs(case)) for case in CASES] + [{"prompt": "Plain text in the same batch."}]
    batched = _outputs(_llm(path), prompts)
    alone_llm = _llm(path, enable_prefix_caching=False)
    alone = [_outputs(alone_llm, [p])[0] for p in prompts]
    _agree(alone, batched, "batched")
    chunked_llm = _llm(path, max_num_batched_tokens=20, enable_chunked_prefill=True)
    _agree(alone, _outputs(chunked_llm, prompts), "chunked")
    tight_llm = _llm(path, num_blocks=9, max_model_len=96)  # a pool too small for all: preemption re-encodes
    _agree(alone, _outputs(tight_llm, prompts), "preempted")
    assert tight_llm.engine.core.scheduler.num_preemptions > 0

    cached_llm = _llm(path, block_size=8)
    first = cached_llm.generate(prompts[:1], _params(), use_tqdm=False)[0]
    again = cached_llm.generate(prompts[:1], _params(), use_tqdm=False)[0]
    span = cached_llm.engine.core.mm_processor.process(prompts[0])[2][0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > span.offset
    _agree([alone[0]], [(again.outputs[0].token_ids, again.outputs[0].logprobs)], "prefix-cached")

    text, _ = _case_inputs(CASES[0])
    other = cached_llm.generate([mm_prompt(text, [sample_image(40, 24, 99)])], _params(), use_tqdm=False)[0]
    assert other.num_cached_tokens <= span.offset // 8 * 8, "a different image hit the first image's blocks"


def test_image_refusals_offline(vlm, smollm2_tokenizer_dir, tiny_llama_dir):
    from vllmpy import LLM

    path, _, _ = vlm
    llm = _llm(path, limit_mm_per_prompt={"image": 1})
    text, images = _case_inputs(CASES[2])
    with pytest.raises(ValueError, match="exceed the limit of 1"):
        llm.generate([mm_prompt(text, images)], _params(), use_tqdm=False)
    with pytest.raises(ValueError, match="has 2 image placeholder"):
        llm.generate([mm_prompt("<start_of_image> <start_of_image>", images[:1])], _params(), use_tqdm=False)
    with pytest.raises(ValueError, match="must be a PIL.Image"):
        llm.generate([mm_prompt("<start_of_image>", ["not an image"])], _params(), use_tqdm=False)
    text_only = LLM(model=tiny_llama_dir, dtype="float32", num_blocks=32)
    with pytest.raises(ValueError, match="takes text only"):
        text_only.generate([mm_prompt("<start_of_image>", images[:1])], _params(), use_tqdm=False)
    # A normal request is still served afterwards.
    served = llm.generate([mm_prompt(*_case_inputs(CASES[0]))], _params(4), use_tqdm=False)[0]
    assert len(served.outputs[0].token_ids) == 4


def test_chat_prompt_matches_transformers(vlm):
    """LLM.chat with image parts renders as transformers' processor does with a template that reads parts
    (the image at its part's place, written by the template), then expands and tokenizes the same."""
    path, _, processor = vlm
    image = sample_image(40, 24, 0)
    text = [{"type": "text", "text": "Describe"}, {"type": "text", "text": " it."}]
    ours = _llm(path).chat([{"role": "user", "content": [text[0], {"type": "image_pil", "image_pil": image},
                                                          text[1]]}], _params(1), use_tqdm=False)[0]
    rendered = processor.apply_chat_template(
        [{"role": "user", "content": [text[0], {"type": "image"}, text[1]]}], add_generation_prompt=True,
        tokenize=False)
    assert ours.prompt_token_ids == processor(text=[rendered], images=[[image]])["input_ids"][0]
