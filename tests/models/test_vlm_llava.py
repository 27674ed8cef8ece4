"""Gate: LlavaForConditionalGeneration on tiny random checkpoints against transformers fp32 — a CLIP tower
read at layer -2 without its class token, and a SigLIP tower read at layers [1, -1] concatenated — on 2
prompts with one image and 1 with two of different sizes; then chunked prefill that splits an image's
span (a causal LM may) and an encoder budget of one image per step give the same tokens."""
from __future__ import annotations

import numpy as np
import pytest

from tests import vlm_models as vlm
from tests.models.test_batch_invariance import _agree

MAX_TOKENS = 32
CASES = [("<image>Describe this picture.", [(40, 24, 0)]), ("What is in <image>? Answer:", [(20, 36, 1)]),
         ("Compare <image> with <image> in one line.", [(64, 48, 2), (17, 29, 3)])]
DESCRIPTIONS = {"clip": "CLIP 3 layers read at -2, class token dropped, 16 tokens per image, Llama LM",
                "siglip": "SigLIP read at layers [1, -1] concatenated, full strategy, Llama LM"}


def _cases():
    return vlm.with_images(CASES)


@pytest.fixture(scope="module", params=["clip", "siglip"])
def llava(request, smollm2_tokenizer_dir, tmp_path_factory):
    return request.param, *vlm.build_tiny_vlm(vlm.make_tiny_llava, smollm2_tokenizer_dir, tmp_path_factory,
                                              f"tiny_llava_{request.param}", request.param)


def test_processor_matches_transformers(llava):
    _, path, _, processor = llava
    llm = vlm.fp32_llm(path)
    for text, images in _cases():
        ref, features = vlm.process_like_transformers(llm, processor, text, images)
        assert np.array_equal(np.stack([f.pixel_values for f in features]), ref["pixel_values"]), text


def test_greedy_matches_transformers(llava, gate_report):
    tower, path, model, processor = llava
    label = f"LlavaForConditionalGeneration/{tower}"
    result = vlm.gate_vlm(vlm.fp32_llm(path), model, processor, _cases(), MAX_TOKENS, label)
    gate_report(label, result, DESCRIPTIONS[tower], len(CASES))
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == len(CASES)


def test_split_spans_and_one_image_per_step(llava):
    from vllmpy import SamplingParams

    _, path, _, _ = llava
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [vlm.mm_prompt(text, images) for text, images in _cases()]

    def run(llm, batch):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(batch, params, use_tqdm=False)]

    alone_llm = vlm.fp32_llm(path, enable_prefix_caching=False)
    alone = [run(alone_llm, [prompt])[0] for prompt in prompts]
    _agree(alone, run(vlm.fp32_llm(path, max_num_batched_tokens=7), prompts), "chunks of 7 across image spans")
    _agree(alone, run(vlm.fp32_llm(path, max_num_encoder_input_tokens=16), prompts), "one image encoded per step")
