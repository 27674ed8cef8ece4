"""Gate: Idefics3ForConditionalGeneration on a tiny random checkpoint (SigLIP-style tower with bucketed
positions + pixel-shuffle connector + Llama) against transformers fp32: the processor's tiles and token
ids on images that split into 2x3, 3x2 and 3x3 grids plus the global image, greedy 32 tokens with
logprobs within 1e-3, and batched / chunked (a chunk ending inside a tile's run, one image encoded per
step) runs giving the same tokens as each prompt alone."""
from __future__ import annotations

import numpy as np
import pytest

from tests import vlm_models as vlm

MAX_TOKENS = 32
CASES = [("<image>Describe this picture.", [(40, 24, 0)]), ("What is in <image>? Answer:", [(20, 36, 1)]),
         ("Compare <image> with <image> in one line.", [(64, 48, 2), (17, 29, 3)])]
TILES = [[7], [7], [10, 7]]  # 2x3 + global, 3x2 + global; 3x3 + global, 3x2 + global


def _cases():
    return vlm.with_images(CASES)


@pytest.fixture(scope="module")
def idefics3(smollm2_tokenizer_dir, tmp_path_factory):
    return vlm.build_tiny_vlm(vlm.make_tiny_idefics3, smollm2_tokenizer_dir, tmp_path_factory, "tiny_idefics3")


def _llm(path, **kwargs):
    return vlm.fp32_llm(path, 96, **kwargs)


def test_processor_matches_transformers(idefics3):
    path, _, processor = idefics3
    llm = _llm(path)
    for (text, images), tiles in zip(_cases(), TILES):
        ref, features = vlm.process_like_transformers(llm, processor, text, images)
        assert [len(f.pixel_values) for f in features] == tiles
        ours = np.concatenate([f.pixel_values for f in features])
        assert ours.dtype == np.float32 and np.array_equal(ours, ref["pixel_values"][0][:len(ours)]), text
        assert not ref["pixel_values"][0][len(ours):].any()  # the rest is the batch's zero padding
        for feature, n in zip(features, tiles):  # tile tags inside the span take no encoder row
            assert feature.embed_mask is not None and feature.embed_mask.sum() == n * vlm.IDEFICS3_TILE_TOKENS


def test_greedy_matches_transformers(idefics3, gate_report):
    path, model, processor = idefics3
    vlm.assert_gate(gate_report, _llm(path), model, processor, _cases(), MAX_TOKENS,
                    "Idefics3ForConditionalGeneration",
                    "SigLIP-style 2 layers on 32x32 tiles, pixel shuffle 2, 16 tokens per tile, up to 3x3 tiles + "
                    "global, Llama LM")


def test_smolvlm_greedy_matches_transformers(smollm2_tokenizer_dir, tmp_path, gate_report):
    """SmolVLMForConditionalGeneration with SmolVLMImageProcessor: served by the same code."""
    model, processor = vlm.make_tiny_idefics3(smollm2_tokenizer_dir, tmp_path, smolvlm=True)
    vlm.assert_gate(gate_report, _llm(str(tmp_path)), model, processor, _cases()[::2], MAX_TOKENS,
                    "SmolVLMForConditionalGeneration", "the Idefics3 tiny config as SmolVLM (its own classes)")


def test_batched_and_chunked_across_tiles(idefics3):
    prompts = [vlm.mm_prompt(text, images) for text, images in _cases()] + [{"prompt": "Plain text too."}]
    vlm.agree_batched_and_chunked(lambda **kw: _llm(idefics3[0], **kw), prompts,
                                  {"max_num_batched_tokens": 37, "max_num_encoder_input_tokens": 200},
                                  "chunks of 37 across tile runs, one image encoded per step")


def test_chat_expands_each_image_by_its_grid(idefics3):
    """LLM.chat renders the image part as the `<image>` marker (the template takes strings), then expands
    it by that image's own tile grid: token ids equal the processor's on the rendered text."""
    from vllmpy import SamplingParams

    path, _, processor = idefics3
    image = vlm.sample_image(64, 48, 2)
    content = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "What is it?"}]
    ours = _llm(path).chat([{"role": "user", "content": content}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    rendered = processor.tokenizer.apply_chat_template([{"role": "user", "content": "<image>\nWhat is it?"}],
                                                       add_generation_prompt=True, tokenize=False)
    assert ours.prompt_token_ids == processor(text=[rendered], images=[[image]])["input_ids"][0]
