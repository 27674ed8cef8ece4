"""Gate for the 2025-26 families (SmolLM3, OLMoE, Granite-MoE, EXAONE 4, Seed-OSS, ERNIE-4.5-MoE,
GLM-4.5, gpt-oss, Llama 4): each on a tiny random config with its real layout, greedy 32 tokens on the
gate prompts vs transformers fp32 (strict or near-tie, logprobs within 1e-3), then batched, chunked,
prefix-cached and preempted runs equal to the prompts run alone (test_batch_invariance's checks)."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.gate import gate_tiny_family


def _base(vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)


def smollm3(vocab: int):
    from transformers import SmolLM3Config

    return SmolLM3Config(**_base(vocab), no_rope_layer_interval=2, tie_word_embeddings=True)


def olmoe(vocab: int):
    from transformers import OlmoeConfig

    return OlmoeConfig(**{**_base(vocab), "intermediate_size": 32}, num_experts=8, num_experts_per_tok=3,
                       clip_qkv=2.0)


def granite_moe(vocab: int):
    from transformers import GraniteMoeConfig

    return GraniteMoeConfig(**{**_base(vocab), "intermediate_size": 32}, num_local_experts=8, num_experts_per_tok=2,
                            embedding_multiplier=12.0, attention_multiplier=0.1, residual_multiplier=0.22,
                            logits_scaling=8.0)


def exaone4(vocab: int):
    from transformers import Exaone4Config

    return Exaone4Config(**_base(vocab), sliding_window=8, sliding_window_pattern=4, tie_word_embeddings=False)


def seed_oss(vocab: int):
    from transformers import SeedOssConfig

    return SeedOssConfig(**_base(vocab), head_dim=32, attention_bias=True, attention_out_bias=False,
                         tie_word_embeddings=False)


def ernie45_moe(vocab: int):
    from transformers import Ernie4_5_MoeConfig

    return Ernie4_5_MoeConfig(**_base(vocab), moe_intermediate_size=32, moe_num_experts=8, moe_k=3,
                              moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_interval=1,
                              use_bias=True, tie_word_embeddings=True)


def glm4_moe(vocab: int):
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**_base(vocab), head_dim=32, moe_intermediate_size=32, n_routed_experts=8,
                         num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                         routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True)


def gpt_oss(vocab: int):
    from transformers import GptOssConfig

    # head_dim 32 with 4 heads over hidden 64; swiglu_limit 1.0 so the clamps bite on these activations.
    return GptOssConfig(**{**_base(vocab), "intermediate_size": 32}, head_dim=32, num_local_experts=8,
                        num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0, attention_bias=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                         "original_max_position_embeddings": 64})


def llama4(vocab: int):
    from transformers import Llama4TextConfig

    # floor_scale 4: the NoPE layer's temperature steps within the prompts; chunks of 8 under ~40 tokens.
    return Llama4TextConfig(**{**_base(vocab), "intermediate_size": 32}, head_dim=16, intermediate_size_mlp=128,
                            num_local_experts=8, num_experts_per_tok=2, interleave_moe_layer_step=2,
                            attention_chunk_size=8, no_rope_layer_interval=4, use_qk_norm=True,
                            attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1, tie_word_embeddings=False)


# gate id -> (config builder, what the tiny config exercises: the gate report's description)
FAMILIES: dict[str, tuple[Callable[[int], object], str]] = {
    "SmolLM3ForCausalLM": (smollm3, "NoPE on every 2nd layer (no_rope_layer_interval 2), GQA 4/2, tied"),
    "OlmoeForCausalLM": (olmoe, "8 experts top-3 (not renormalized), q/k RMSNorm over the projection, "
                                "clip_qkv 2"),
    "GraniteMoeForCausalLM": (granite_moe, "8 experts top-2 (softmax over the top-k logits), stacked "
                                           "input/output_linear experts, Granite's 4 muP scalars"),
    "Exaone4ForCausalLM": (exaone4, "post-norms only, per-head q/k RMSNorm, 3 sliding (window 8, rope) + "
                                    "1 global NoPE layer"),
    "SeedOssForCausalLM": (seed_oss, "q/k/v bias without o bias, head_dim 32 != hidden/heads, GQA 4/2"),
    "Ernie4_5_MoeForCausalLM": (ernie45_moe, "8 experts top-3 chosen with the correction bias + 2 ungated shared, "
                                             "layer 0 dense, interleaved rope, biases everywhere"),
    "Glm4MoeForCausalLM": (glm4_moe, "8 experts sigmoid top-3 in 2 of 4 groups + bias, scaling 2.5, shared "
                                     "expert, layer 0 dense, half rotary, q/k norm, qkv bias"),
    "GptOssForCausalLM": (gpt_oss, "attention sinks, sliding 8 / full alternation, 8 experts top-2 with biases, "
                                   "clamped SwiGLU (limit 1), router bias, YaRN untruncated, q/k/v/o bias"),
    "Llama4ForCausalLM": (llama4, "3 chunked (8) rope layers with L2 q/k norm + 1 NoPE global layer with "
                                  "temperature tuning, 8 experts top-2 sigmoid on inputs + shared expert "
                                  "on odd layers, interleaved rope"),
}


@pytest.mark.parametrize("gate_id", list(FAMILIES))
def test_family_matches_transformers_and_is_batch_invariant(gate_id, smollm2_tokenizer_dir, tmp_path, gate_report):
    make_config, description = FAMILIES[gate_id]
    gate_tiny_family(gate_id, make_config, description, smollm2_tokenizer_dir, tmp_path, gate_report)
