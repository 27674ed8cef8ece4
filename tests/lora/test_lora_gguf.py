"""An adapter on a packed GGUF base: the projections stay Q8_0 blocks (the packed kernels compute them) and the
LoRA delta is added to their output. Oracle: transformers + peft on the dequantized weights."""
from __future__ import annotations

import gguf
import torch
from gguf import GGMLQuantizationType as Q

from tests.gate import GateResult, compare, reference_greedy
from tests.gguf.test_gguf_archs import _metadata, _tensors, add_vocab, write_tensors
from tests.lora.adapters import ATTENTION, MLP, AdapterSpec, make_adapter
from tests.tiny_models import make_tiny_checkpoint
from vllmpy import LLM, LoRARequest, SamplingParams
from vllmpy.loader.gguf import GGUFCheckpoint

PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5,"]
MAX_TOKENS = 32
_PROJECTIONS = tuple(f"{name}.weight" for name in ATTENTION + MLP)


def _config(vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _quantize_projections(model: torch.nn.Module) -> None:
    """Every projection becomes what Q8_0 stores (so the HF model holds the GGUF file's dequantized weights)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(_PROJECTIONS):
                blocks = gguf.quants.quantize(p.numpy(), Q.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q8_0)))


def _write_gguf(model: torch.nn.Module, path, smollm2_gguf_path: str) -> None:
    """llama.cpp's llama layout (q/k rows permuted), projections in Q8_0, the rest F32, SmolLM2's vocabulary."""
    vocab = GGUFCheckpoint(smollm2_gguf_path).metadata  # our reader: gguf-py's takes ~8 s on this file
    w = gguf.GGUFWriter(str(path), "llama")
    _metadata("llama", w, model.config)  # the generic keys: no family branch there names "llama"
    add_vocab(w, vocab)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # "mixtral" is test_gguf_archs' llama-arch writer with llama.cpp's q/k permutation (no experts here).
    write_tensors(w, _tensors("mixtral", state, model.config),
                  lambda name, data: Q.Q8_0 if name.startswith("blk.") and data.ndim == 2 else None)


def test_adapter_on_packed_q8_0_base_matches_peft(smollm2_tokenizer_dir, smollm2_gguf_path, tmp_path):
    base = make_tiny_checkpoint("LlamaForCausalLM", smollm2_tokenizer_dir, tmp_path / "hf", make_config=_config)
    _quantize_projections(base)
    _write_gguf(base, tmp_path / "tiny.gguf", smollm2_gguf_path)
    reference = make_adapter(base, tmp_path / "lora", AdapterSpec(8, 16, tuple(ATTENTION + MLP)), seed=5)
    llm = LLM(model=str(tmp_path / "tiny.gguf"), dtype="float32", enable_lora=True, num_blocks=32, max_model_len=256)
    layer = llm.engine.core.model.model.layers[0]
    assert layer.self_attn.qkv_proj.packed is not None and layer.mlp.down_proj.packed is not None  # kept packed
    assert torch.equal(layer.mlp.down_proj.packed.dequantize(), base.model.layers[0].mlp.down_proj.weight)
    lora = LoRARequest("q8", 1, str(tmp_path / "lora"))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    result = GateResult()
    base_outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for output, base_output in zip(llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora), base_outputs):
        completion = output.outputs[0]
        assert completion.token_ids != base_output.outputs[0].token_ids  # the adapter changed the tokens
        ref_tokens, ref_logits = reference_greedy(reference, output.prompt_token_ids, MAX_TOKENS)
        logprobs = [pos[t].logprob for pos, t in zip(completion.logprobs, completion.token_ids)]
        compare(result, f"q8_0 + lora {output.prompt!r}", completion.token_ids, logprobs, ref_tokens, ref_logits)
    print(result.summary())
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == len(PROMPTS)
