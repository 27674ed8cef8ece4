"""Gate for the Gated DeltaNet and short-conv hybrids (Qwen3.5 dense / MoE, Qwen3-Next, LFM2; the
vision-language Qwen3.5 checkpoints, text and images, are gated in tests/models/test_vlm_qwen3_5.py):
each on a tiny random config with its family's real layer pattern, greedy 32 tokens on the gate prompts
plus one of more than two delta-rule chunks vs transformers fp32 (strict or near-tie, logprobs within
1e-3); on Qwen3.5 (Gated DeltaNet) and LFM2 (short conv) the Mamba2 gate's batched,
chunked-prefill (the recurrent state carried across steps) and preempted runs equal to each prompt
run alone."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.gate import gate_tiny_family
from tests.models.test_gate_transformers import PROMPTS
from tests.models.test_hybrid_mamba import check_state_invariance

# Qwen3.5's real pattern: three Gated DeltaNet layers, then one gated full attention. Value heads
# outnumber key heads (4 / 2, as 32 / 16 in Qwen3.5-9B), GQA 4 / 2 in attention, head_dim 32.
_QWEN = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
             linear_conv_kernel_dim=4, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)
# ~196 tokens: four of the delta rule's 64-token chunks in one prefill step (the gate's short prompts
# alone never leave the first chunk), short enough that its 32 generated tokens fit max_model_len 256.
LONG_PROMPT = " ".join(f"step {i}: add {i % 7} to the total, then write it down." for i in range(12))
GATE_PROMPTS = PROMPTS + [LONG_PROMPT]
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def qwen3_5(vocab: int):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(vocab_size=vocab, intermediate_size=128, tie_word_embeddings=True, **_QWEN)


def qwen3_5_moe(vocab: int):
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(vocab_size=vocab, **_QWEN, **_MOE)


def qwen3_next(vocab: int):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(vocab_size=vocab, intermediate_size=128, mlp_only_layers=[2], norm_topk_prob=True,
                           **_QWEN, **_MOE)


def lfm2(vocab: int):
    from transformers import Lfm2Config

    return Lfm2Config(vocab_size=vocab, hidden_size=64, intermediate_size=192, block_multiple_of=16,
                      num_hidden_layers=6, full_attn_idxs=[2, 5], num_attention_heads=4, num_key_value_heads=2,
                      conv_L_cache=3, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


# gate id -> (config builder, what the tiny config exercises: the gate report's description)
FAMILIES: dict[str, tuple[Callable[[int], object], str]] = {
    "Qwen3_5ForCausalLM": (qwen3_5, "3 GDN + 1 gated full attention, value heads 4 / key heads 2, partial rotary "
                                    "0.25, zero-centred norms, tied"),
    "Qwen3_5MoeForCausalLM": (qwen3_5_moe, "Qwen3.5 pattern, every layer 8 experts top-2 (renormalized) + "
                                           "sigmoid-gated shared expert"),
    "Qwen3NextForCausalLM": (qwen3_next, "interleaved qkvz / ba projections, 3 GDN + 1 full, 8 experts top-2 + "
                                         "shared expert, layer 2 dense (mlp_only_layers)"),
    "Lfm2ForCausalLM": (lfm2, "6 layers: short conv (L_cache 3) with attention at 2 and 5, q/k RMSNorm, "
                              "auto-adjusted FFN width"),
}


# One batched + chunked + preempted run per mixer kind: Gated DeltaNet, short conv.
STATE_INVARIANCE = ("Qwen3_5ForCausalLM", "Lfm2ForCausalLM")


@pytest.mark.parametrize("gate_id", list(FAMILIES))
def test_hybrid_matches_transformers_and_is_batch_invariant(gate_id, smollm2_tokenizer_dir, tmp_path, gate_report):
    make_config, description = FAMILIES[gate_id]
    gate_tiny_family(gate_id, make_config, description, smollm2_tokenizer_dir, tmp_path, gate_report, GATE_PROMPTS,
                     _check_long_then_state, gate_id in STATE_INVARIANCE, max_num_seqs=8)


def _check_long_then_state(llm) -> None:
    assert 192 < len(llm.get_tokenizer().encode(LONG_PROMPT)) <= 256 - 32  # four delta-rule chunks, and room
    check_state_invariance(llm)

