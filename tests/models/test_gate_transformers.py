"""Gate: each architecture on a tiny random config with its family's real head layout, greedy 32
tokens on 4 prompts vs transformers fp32, token for token (or near-tie), chosen logprobs within 1e-3."""
from __future__ import annotations

import pytest

from tests.gate import gate_llm
from tests.tiny_models import ARCHITECTURES, DESCRIPTIONS, make_tiny_checkpoint

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village",
           "1, 2, 3, 4, 5,"]
MAX_TOKENS = 32


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers(arch, smollm2_tokenizer_dir, tmp_path, gate_report):
    from vllmpy import LLM

    ref_model = make_tiny_checkpoint(arch, smollm2_tokenizer_dir, tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64, block_size=16)
    result = gate_llm(llm, ref_model, PROMPTS, MAX_TOKENS, arch)
    gate_report(arch, result, DESCRIPTIONS.get(arch, ""), len(PROMPTS))
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == len(PROMPTS)
