"""A quantized checkpoint's bf16 / f16 embedding and LM head stay in their stored dtype, mapped from the file
(vllmpy/loader/quantization/tables.py): the lookup upcasts only the gathered rows (exact) and the head computes
through the BF16 / F16 block kernels. Greedy 32 tokens strict or near-tie vs transformers fp32 on the same
(dequantized, bf16-rounded) weights, for an untied head (Llama, both tables f16 / bf16) and a tied one (Qwen2)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.gate import gate_llm
from tests.quant.checkpoints import make_quantized_checkpoint
from tests.quant.test_gate import MAX_TOKENS, PROMPTS

BLOCK_TYPES = {torch.bfloat16: 30, torch.float16: 1}


def _store_tables(model_dir, reference, dtype: torch.dtype) -> list[str]:
    """Rewrite the checkpoint's embedding / head in `dtype`, the reference model rounded the same way."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    tables = [name for name in tensors if name.endswith(("embed_tokens.weight", "lm_head.weight"))]
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for name in tables:
            tensors[name] = tensors[name].to(dtype)
            params[name].copy_(tensors[name].float())
    save_file(tensors, str(path))
    return tables


@pytest.mark.parametrize("arch,dtype", [("LlamaForCausalLM", torch.float16), ("Qwen2ForCausalLM", torch.bfloat16)])
def test_stored_tables_stay_packed_and_match_transformers(arch, dtype, smollm2_tokenizer_dir, tmp_path):
    from vllmpy import LLM

    reference = make_quantized_checkpoint(arch, "fp8-tensor-static", smollm2_tokenizer_dir, tmp_path)
    tables = _store_tables(tmp_path, reference, dtype)
    assert len(tables) == (2 if arch == "LlamaForCausalLM" else 1)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=32, block_size=16)
    model = llm.engine.core.model
    embed, head = model.model.embed_tokens.packed, model.lm_head.packed
    assert embed is not None and head is not None, "the stored tables were upcast at load"
    assert embed.ggml_type == head.ggml_type == BLOCK_TYPES[dtype]
    assert model.model.embed_tokens.weight.numel() == 0  # no float32 copy beside the mapped table
    result = gate_llm(llm, reference, PROMPTS, MAX_TOKENS, f"{arch} fp8 + {dtype} tables")
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == len(PROMPTS)
