"""Gate for the MLA families (DeepSeek-V2, DeepSeek-V3, GLM-4.7-Flash, MiniCPM3): each on a tiny random
config with the real head layout (q_lora on and off, a latent of kv_lora_rank + rope, v_head_dim !=
qk_head_dim), greedy 32 tokens on the gate prompts vs transformers fp32 (strict or near-tie, logprobs
within 1e-3), then batched, chunked, prefix-cached and preempted runs equal to the prompts run alone."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.gate import gate_tiny_family

# YaRN stretched 4x with DeepSeek's mscale / mscale_all_dim: both the rope and the softmax scale change.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}


def _mla(vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                pad_token_id=0, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24)


def _moe(experts: int = 8, top_k: int = 3) -> dict:
    return dict(n_routed_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=24, n_shared_experts=1,
                first_k_dense_replace=1)


def deepseek_v2(vocab: int):
    from transformers import DeepseekV2Config

    return DeepseekV2Config(**_mla(vocab), **_moe(), q_lora_rank=None, topk_method="greedy",
                            routed_scaling_factor=1.5, tie_word_embeddings=False)


def deepseek_v2_grouped(vocab: int):
    from transformers import DeepseekV2Config

    return DeepseekV2Config(**_mla(vocab), **_moe(), q_lora_rank=24, topk_method="group_limited_greedy", n_group=4,
                            topk_group=2, rope_parameters=YARN, tie_word_embeddings=False)


def deepseek_v3(vocab: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**_mla(vocab), **_moe(), q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                            routed_scaling_factor=2.5, rope_parameters=YARN, rope_interleave=True)


def glm4_moe_lite(vocab: int):
    from transformers import Glm4MoeLiteConfig

    return Glm4MoeLiteConfig(**_mla(vocab), **_moe(), q_lora_rank=24, n_group=1, topk_group=1, norm_topk_prob=True,
                             routed_scaling_factor=1.8, rope_interleave=False)


def minicpm3(vocab: int):
    from transformers import MiniCPM3Config

    return MiniCPM3Config(**_mla(vocab), q_lora_rank=24, scale_emb=12.0, scale_depth=1.4, dim_model_base=16,
                          tie_word_embeddings=True)


# gate id -> (config builder, what the tiny config exercises: the gate report's description)
FAMILIES: dict[str, tuple[Callable[[int], object], str]] = {
    "DeepseekV2ForCausalLM": (deepseek_v2, "MLA without q_lora (latent 32 + rope 8, v 24), interleaved rope; "
                                           "8 experts top-3 softmax (greedy), x1.5, shared expert, layer 0 dense"),
    "DeepseekV2ForCausalLM/grouped-yarn": (deepseek_v2_grouped, "q_lora 24, group_limited_greedy 4 groups / 2, "
                                                                "YaRN x4 with mscale 0.707 / mscale_all_dim 1"),
    "DeepseekV3ForCausalLM": (deepseek_v3, "q_lora 24, sigmoid router + e_score_correction_bias, 4 groups / 2 "
                                           "(top-2 group score), norm_topk_prob, x2.5, YaRN mscale, layer 0 dense"),
    "Glm4MoeLiteForCausalLM": (glm4_moe_lite, "DeepSeek-V3 block, one group, rotate-half rope, x1.8, "
                                              "mlp_layer_types dense/sparse/sparse"),
    "MiniCPM3ForCausalLM": (minicpm3, "dense MLA (q_lora 24), rotate-half rope, embeddings x12, residual x1.4/sqrt(3), "
                                      "hidden / 4 before the tied head"),
}


@pytest.mark.parametrize("gate_id", list(FAMILIES))
def test_mla_family_matches_transformers_and_is_batch_invariant(gate_id, smollm2_tokenizer_dir, tmp_path,
                                                                gate_report):
    # make_tiny_checkpoint randomizes V3's zero-saved e_score_correction_bias, so the bias takes part in routing.
    make_config, description = FAMILIES[gate_id]
    gate_tiny_family(gate_id, make_config, description, smollm2_tokenizer_dir, tmp_path, gate_report)


# The real checkpoints' config.json keys (transformers 4 layout: rope_scaling "type", topk_method, scoring_func).
V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
           "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
           "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6,
           "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": None,
           "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "greedy",
           "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0, "n_group": 1,
           "topk_group": 1, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
           "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 0.707,
                            "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}}
V3 = {**V2_LITE, "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "num_hidden_layers": 61,
      "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "n_routed_experts": 256,
      "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "topk_method": "noaux_tc",
      "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
      "moe_intermediate_size": 2048, "num_nextn_predict_layers": 1,
      "rope_scaling": {**V2_LITE["rope_scaling"], "mscale": 1.0, "mscale_all_dim": 1.0}}


@pytest.mark.parametrize("config", [V2_LITE, V3], ids=["DeepSeek-V2-Lite", "DeepSeek-V3"])
def test_real_configs_build_their_layout(config):
    """Built on the meta device: the latent cache spec, the dense / sparse layers, the router, the scale."""
    import math

    import torch

    from vllmpy.attention.mla import MLAAttentionSpec, MultiHeadLatentAttention
    from vllmpy.layers.moe import SparseMoE
    from vllmpy.models.registry import resolve_model_class

    with torch.device("meta"):
        model = resolve_model_class(config)(config)
    specs = model.kv_cache_specs(16, torch.bfloat16)
    assert specs == [MLAAttentionSpec(16, 1, 576, torch.bfloat16)] * config["num_hidden_layers"]
    assert specs[0].page_bytes == 16 * 576 * 2
    layers = model.model.layers
    sparse = [i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoE)]
    assert sparse == list(range(config["first_k_dense_replace"], config["num_hidden_layers"]))
    routing = layers[-1].mlp.gate.routing
    v3 = config is V3
    assert (routing.scoring, routing.n_group, routing.topk_group, routing.renormalize, routing.group_by_top2) == (
        ("sigmoid", 8, 4, True, True) if v3 else ("softmax", 1, 1, False, False))
    assert (layers[-1].mlp.gate.e_score_correction_bias is not None) == v3
    attn = layers[0].self_attn
    assert isinstance(attn, MultiHeadLatentAttention) and hasattr(attn, "q_a_proj") == v3
    mscale = 0.1 * config["rope_scaling"]["mscale_all_dim"] * math.log(40) + 1
    assert attn.attn.spec.scale == pytest.approx(192 ** -0.5 * mscale ** 2)
    assert model.model.rotary["full_attention"].attention_scaling == pytest.approx(1.0)  # mscale / mscale_all_dim
