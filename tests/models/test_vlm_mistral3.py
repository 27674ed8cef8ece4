"""Gate: Mistral3ForConditionalGeneration on a tiny random checkpoint (Pixtral tower with 2-D rotary +
patch merger + Mistral LM) against transformers fp32: the processor's pixel values (each image at its own
patch-aligned size, one shrunk to fit the longest edge) and token ids ([IMG] rows, [IMG_BREAK],
[IMG_END]), greedy 32 tokens with logprobs within 1e-3, and batched / chunked runs (a chunk ending
inside an image's rows, one image encoded per step) giving the same tokens as each prompt alone."""
from __future__ import annotations

import numpy as np
import pytest

from tests import vlm_models as vlm

MAX_TOKENS = 32
CASES = [("[IMG]Describe this picture.", [(40, 24, 0)]), ("What is in [IMG]? Answer:", [(100, 60, 1)]),
         ("Compare [IMG] with [IMG] in one line.", [(64, 48, 2), (17, 29, 3)])]
GRIDS = [[(3, 5)], [(5, 8)], [(6, 8), (4, 3)]]  # (rows, cols) of merged patches; 100x60 shrinks to 64x38


def _cases():
    return vlm.with_images(CASES)


@pytest.fixture(scope="module")
def mistral3(smollm2_tokenizer_dir, tmp_path_factory):
    return vlm.build_tiny_vlm(vlm.make_tiny_mistral3, smollm2_tokenizer_dir, tmp_path_factory, "tiny_mistral3")


def test_processor_matches_transformers(mistral3):
    path, _, processor = mistral3
    llm = vlm.fp32_llm(path)
    for (text, images), grids in zip(_cases(), GRIDS):
        ref, features = vlm.process_like_transformers(llm, processor, text, images)
        for feature, (height, width), padded, (rows, cols) in zip(features, ref["image_sizes"], ref["pixel_values"],
                                                                  grids):
            assert feature.pixel_values.shape == (3, rows * 8, cols * 8) == (3, height, width)
            assert np.array_equal(feature.pixel_values, padded[:, :height, :width]), text
            # the span runs from the first [IMG] to the last; its [IMG_BREAK]s take no encoder row
            assert feature.length == rows * cols + rows - 1 and feature.embed_mask.sum() == rows * cols


def test_greedy_matches_transformers(mistral3, gate_report):
    path, model, processor = mistral3
    vlm.assert_gate(gate_report, vlm.fp32_llm(path), model, processor, _cases(), MAX_TOKENS,
                    "Mistral3ForConditionalGeneration",
                    "Pixtral 2 layers (2-D rotary) on 4x4 patches, 2x2 patch merger, images at their own size up to "
                    "64 px, Mistral LM")


def test_batched_and_chunked_across_rows(mistral3):
    prompts = [vlm.mm_prompt(text, images) for text, images in _cases()] + [{"prompt": "Plain text too."}]
    vlm.agree_batched_and_chunked(lambda **kw: vlm.fp32_llm(mistral3[0], **kw), prompts,
                                  {"max_num_batched_tokens": 9, "max_num_encoder_input_tokens": 60},
                                  "chunks of 9 across image rows, one image encoded per step")
