"""Gate: a tiny model in each quantized format, computed on its packed blocks, greedy 32 tokens token for
token (or near-tie) against transformers fp32 on the reference-dequantized weights; chosen logprobs within
1e-3. Llama for every format (the group-128 ones on a wider Llama, through Q4Z128 blocks), Qwen2 (qkv bias,
tied head) and Qwen3-MoE (per-expert quantized experts) for one format of each
method (GPTQ, AWQ, compressed-tensors, fp8; MXFP4's MoE gate is gpt-oss, tests/quant/test_mxfp4.py)."""
from __future__ import annotations

import pytest

from tests.gate import gate_llm
from tests.quant.checkpoints import CONFIGS, make_quantized_checkpoint
from vllmpy.loader.quantization.blocks import Q4Z128

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 32
CASES = ([("LlamaForCausalLM", fmt) for fmt in CONFIGS]
         + [("Qwen2ForCausalLM", "gptq-int4-g32-act-order"), ("Qwen3MoeForCausalLM", "ct-w4a16-asym-g32"),
            ("Qwen3MoeForCausalLM", "fp8-block"), ("Qwen3MoeForCausalLM", "gptq-int4-g32-act-order"),
            ("Qwen3MoeForCausalLM", "awq-int4-g32")])


@pytest.mark.parametrize("arch,fmt", CASES)
def test_quantized_greedy_matches_transformers(arch, fmt, smollm2_tokenizer_dir, tmp_path):
    from vllmpy import LLM

    reference = make_quantized_checkpoint(arch, fmt, smollm2_tokenizer_dir, tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=32, block_size=16)
    packed = [m for m in llm.engine.core.model.modules() if getattr(m, "packed", None) is not None
              or len(getattr(m, "segments", [])) > 1]
    assert packed, "no linear layer kept its weight packed"
    if "-g128" in fmt:  # zero points in groups of 128: every linear on the group-wide blocks
        assert {s.ggml_type for m in packed for s in getattr(m, "segments", None) or [m.packed]} == {Q4Z128}
    if "Moe" in arch:
        experts = [m for m in llm.engine.core.model.modules() if hasattr(m, "packed_parts")]
        assert experts and all(m.packed is not None for m in experts), "MoE experts were not kept packed"
    result = gate_llm(llm, reference, PROMPTS, MAX_TOKENS, f"{arch} {fmt}")
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == len(PROMPTS)


def test_dequantized_at_load_path_matches_too(smollm2_tokenizer_dir, tmp_path, monkeypatch):
    """The path devices without the block kernels take (here forced with VLLMPY_GGUF_KEEP_QUANT=0): every
    quantized weight dequantized to dense at load, to the same values."""
    from vllmpy import LLM

    monkeypatch.setenv("VLLMPY_GGUF_KEEP_QUANT", "0")
    reference = make_quantized_checkpoint("LlamaForCausalLM", "awq-int4-g64", smollm2_tokenizer_dir, tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=32, block_size=16)
    assert all(getattr(m, "packed", None) is None for m in llm.engine.core.model.modules())
    result = gate_llm(llm, reference, PROMPTS, MAX_TOKENS, "LlamaForCausalLM awq dense")
    assert not result.failures and result.strict + result.near_tie == len(PROMPTS)
