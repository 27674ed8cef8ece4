"""LongRoPE (Phi-3) serves one frequency set for every position: the long factors when max_model_len
outgrows the original context (the gate's Phi3ForCausalLM: prompts longer than it, where transformers
uses them too), else the short ones, gated here against transformers on sequences within it."""
from __future__ import annotations

import torch

from tests.gate import gate_llm
from tests.models.test_gate_transformers import PROMPTS
from tests.tiny_models import make_tiny_checkpoint
from vllmpy.layers.rotary import RotaryEmbedding

MAX_TOKENS = 32  # every prompt + output stays within the original context of 64


def test_factor_set_follows_the_serving_length():
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
              "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0]}
    base = 10000.0 ** (torch.arange(0, 4, 2).float() / 4)
    short, long = 1 / (torch.tensor([1.0, 2.0]) * base), 1 / (torch.tensor([3.0, 4.0]) * base)
    assert torch.allclose(RotaryEmbedding(4, params, 256, serving_len=64).inv_freq, short)
    assert torch.allclose(RotaryEmbedding(4, params, 256, serving_len=65).inv_freq, long)
    assert torch.allclose(RotaryEmbedding(4, params, 256).inv_freq, long)  # serving the checkpoint's whole context


def test_short_factors_within_the_original_context_match_transformers(smollm2_tokenizer_dir, tmp_path):
    from vllmpy import LLM

    reference = make_tiny_checkpoint("Phi3ForCausalLM/short-rope", smollm2_tokenizer_dir, tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=16, block_size=16, max_model_len=64)
    result = gate_llm(llm, reference, PROMPTS, MAX_TOKENS, "Phi3 short-rope")
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == len(PROMPTS)
