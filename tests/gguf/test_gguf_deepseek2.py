"""GGUF `deepseek2` (DeepSeek-V2 / V3, Kimi K2): a tiny HF checkpoint written as llama.cpp's converter
writes it (DeepseekV2Model: MLA stated as MQA with key_length_mla / value_length_mla, kv_b_proj split
into k_b (transposed) and v_b, experts stacked, e_score_correction_bias as exp_probs_b.bias, YaRN's
mscale_all_dim as yarn_log_multiplier, MTP layers dropped), and an older file that keeps kv_b_proj whole;
our engine on the file gives the HF model's greedy tokens (the gate's strict / near-tie rule)."""
from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from tests.gate import gate_llm
from tests.gguf.test_gguf_archs import PROMPTS, _one_thread, _stack_experts, add_vocab, vocab, write_tensors  # noqa: F401 (fixtures)

MAX_TOKENS = 16
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 0.707}


def _config(name: str, vocab_size: int):
    from transformers import DeepseekV2Config, DeepseekV3Config

    base = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6,
                bos_token_id=1, eos_token_id=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=24, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
                n_shared_experts=1, first_k_dense_replace=1, tie_word_embeddings=False)
    if name == "v3-split":
        return DeepseekV3Config(**base, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                                routed_scaling_factor=2.5, rope_parameters=YARN)
    return DeepseekV2Config(**base, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.5)


def _metadata(w: gguf.GGUFWriter, c, split: bool) -> None:
    d = c.to_dict()
    heads, rope, lora = d["num_attention_heads"], d["qk_rope_head_dim"], d["kv_lora_rank"]
    w.add_context_length(d["max_position_embeddings"])
    w.add_embedding_length(d["hidden_size"])
    w.add_block_count(d["num_hidden_layers"])
    w.add_feed_forward_length(d["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1 if split else heads)
    w.add_rope_freq_base(d["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    w.add_expert_used_count(d["num_experts_per_tok"])
    w.add_leading_dense_block_count(d["first_k_dense_replace"])
    w.add_vocab_size(d["vocab_size"])
    if d.get("q_lora_rank"):
        w.add_q_lora_rank(d["q_lora_rank"])
    w.add_kv_lora_rank(lora)
    if split:  # newer converters: MLA as MQA over the latent, the per-head sizes under *_mla
        w.add_key_length(lora + rope)
        w.add_value_length(lora)
        w.add_key_length_mla(d["qk_nope_head_dim"] + rope)
        w.add_value_length_mla(d["v_head_dim"])
    else:
        w.add_key_length(d["qk_nope_head_dim"] + rope)
        w.add_value_length(d["v_head_dim"])
    w.add_expert_feed_forward_length(d["moe_intermediate_size"])
    w.add_expert_count(d["n_routed_experts"])
    w.add_expert_shared_count(d["n_shared_experts"])
    w.add_expert_weights_scale(d["routed_scaling_factor"])
    w.add_expert_weights_norm(bool(d["norm_topk_prob"]))
    sigmoid = d["model_type"] == "deepseek_v3"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if sigmoid:
        w.add_expert_group_count(d["n_group"])
        w.add_expert_group_used_count(d["topk_group"])
    w.add_rope_dimension_count(rope)
    scaling = d["rope_parameters"]
    if scaling.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])


def _tensors(state: dict[str, torch.Tensor], c, split: bool) -> dict:
    d = c.to_dict()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, d["num_hidden_layers"])
    state = {k.replace("e_score_correction_bias", "e_score_correction.bias"): v for k, v in state.items()}
    _stack_experts(state)
    out = {}
    for hf, tensor in state.items():
        if split and hf.endswith("kv_b_proj.weight"):  # the converter's split, k_b transposed
            kv_b = tensor.view(d["num_attention_heads"], -1, tensor.shape[-1])
            k_b, v_b = kv_b.split([d["qk_nope_head_dim"], d["v_head_dim"]], dim=1)
            pieces = {hf.replace("kv_b_proj", "k_b_proj"): k_b.transpose(1, 2),
                      hf.replace("kv_b_proj", "v_b_proj"): v_b}
        else:
            pieces = {hf: tensor}
        for piece, value in pieces.items():
            mapped = names.get_name(piece, try_suffixes=(".weight", ".bias"))
            assert mapped is not None, f"gguf-py has no llama.cpp name for {piece}"
            out[mapped] = value.float().contiguous().numpy()
    return out


def _write(name: str, vocab: dict, out: Path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = _config(name, len(vocab["tokenizer.ggml.tokens"]))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            is_norm = "norm" in param_name
            p.normal_(0.0, 0.3 if p.dim() == 1 or is_norm else 0.15)
            if is_norm and param_name.endswith("weight"):
                p.add_(1.0)
        for buffer_name, b in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    model.save_pretrained(out / "hf")
    split = name.endswith("split")
    path = out / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK2])
    _metadata(w, config, split)
    add_vocab(w, vocab)
    write_tensors(w, _tensors(load_file(out / "hf" / "model.safetensors"), config, split))
    return model, path


@pytest.mark.parametrize("name", ["v2-whole", "v3-split"])
def test_deepseek2_gguf_greedy_matches_transformers(name, vocab, tmp_path):
    from vllmpy import LLM

    reference, path = _write(name, vocab, tmp_path)
    llm = LLM(model=str(path), dtype="float32", num_blocks=32, block_size=16, max_model_len=256)
    config = llm.engine.core.checkpoint.config
    assert config["architectures"] == reference.config.architectures
    assert (config["qk_nope_head_dim"], config["v_head_dim"], config["kv_lora_rank"]) == (16, 24, 32)
    if name == "v3-split":
        assert config["rope_scaling"]["mscale_all_dim"] == pytest.approx(YARN["mscale_all_dim"])
        assert (config["scoring_func"], config["topk_method"], config["n_group"]) == ("sigmoid", "noaux_tc", 4)
    result = gate_llm(llm, reference, PROMPTS, MAX_TOKENS, f"gguf deepseek2 {name}")
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == len(PROMPTS)
