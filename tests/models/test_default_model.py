"""Gate on real weights: the embedded Gemma 3 270M Q4_K_M against transformers on the same GGUF
(dequantized to fp32 by both), greedy tokens and prompt logprobs."""
from __future__ import annotations

import os

import pytest
import torch

from tests.gate import LOGPROB_TOL, gate_llm

PROMPTS = ["The capital of France is", "def add(a, b):", "The three primary colors are",
           "Water boils at a temperature of"]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def llm():
    from vllmpy import LLM
    return LLM(dtype="float32", num_blocks=64, max_model_len=1024)


@pytest.fixture(scope="module")
def reference(gemma3_gguf_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(gemma3_gguf_path),
                                                gguf_file=os.path.basename(gemma3_gguf_path),
                                                dtype=torch.float32).eval()


def test_default_model_greedy_matches_transformers(llm, reference):
    result = gate_llm(llm, reference, PROMPTS, MAX_TOKENS, "default model")
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == len(PROMPTS)


def test_default_model_prompt_logprobs_match_transformers(llm, reference):
    from vllmpy import SamplingParams

    output = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
    ids = output.prompt_token_ids
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(ids)
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)
    for pos in range(1, len(ids)):
        entry = output.prompt_logprobs[pos]
        assert abs(entry[ids[pos]].logprob - float(ref[pos - 1, ids[pos]])) < LOGPROB_TOL
        top = ref[pos - 1].topk(5)
        assert entry[ids[pos]].rank == int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1
        for rank, (lp, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert abs(entry[tid].logprob - lp) < LOGPROB_TOL
            assert entry[tid].rank == rank or tid == ids[pos]
