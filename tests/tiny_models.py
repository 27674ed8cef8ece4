"""Tiny random-weight checkpoints of each architecture, saved by transformers with a real tokenizer."""
from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Gate ids: an architecture name, or `name/variant` for a second config of the same family.
ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Gemma3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "PhiForCausalLM", "Phi3ForCausalLM",
                 "OPTForCausalLM", "OPTForCausalLM/post-norm", "GPT2LMHeadModel", "StableLmForCausalLM",
                 "StableLmForCausalLM/parallel", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "GraniteForCausalLM",
                 "Glm4ForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "InternLM3ForCausalLM",
                 "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"]
# Norms that scale by (1 + w): their random weights stay near 0 rather than near 1.
_ONE_PLUS_NORMS = {"Gemma3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM"}
# What each id's tiny config exercises (the gate report's description column).
DESCRIPTIONS = {
    "LlamaForCausalLM": "GQA 4/2, llama3 rope scaling, untied head",
    "MistralForCausalLM": "GQA 4/2, sliding window 8 on every layer",
    "Qwen2ForCausalLM": "qkv bias, tied embeddings",
    "Qwen3ForCausalLM": "q/k RMSNorm, head_dim 32 != hidden/heads, MQA",
    "Gemma3ForCausalLM": "sliding 8 / global alternation with two rope bases, q/k norm, final soft-cap 30",
    "GemmaForCausalLM": "Gemma RMSNorm, scaled embeddings, legacy hidden_act=gelu (tanh), MQA, head_dim 32",
    "Gemma2ForCausalLM": "attention soft-cap 5, final soft-cap 10, sliding 8 / global alternation, 4 norms",
    "PhiForCausalLM": "parallel block, partial rotary 0.5, LayerNorm, q/k LayerNorm, biases, gelu_new",
    "Phi3ForCausalLM": "longrope long factors (prompts outgrow original context 4), partial rotary 0.75, "
                       "sliding 16, tied",
    "OPTForCausalLM": "learned positions (offset 2), pre-LayerNorm, ReLU, biases, tied",
    "OPTForCausalLM/post-norm": "do_layer_norm_before=False, word_embed_proj_dim 32 (project_in/out)",
    "GPT2LMHeadModel": "Conv1D [in, out] weights, fused c_attn, learned positions, scale by inverse layer idx",
    "StableLmForCausalLM": "partial rotary 0.25, qkv bias, per-head q/k LayerNorm, sequential residual",
    "StableLmForCausalLM/parallel": "parallel residual, partial rotary 0.25, no qkv bias",
    "Olmo2ForCausalLM": "post-norms only, q/k RMSNorm over the whole projection",
    "Olmo3ForCausalLM": "OLMo 2 block, 3 of 4 layers sliding (window 8)",
    "GraniteForCausalLM": "embedding x12, attention x0.1, residual x0.22, logits / 8",
    "Glm4ForCausalLM": "4 norms, interleaved partial rotary 0.5, qkv bias, fused gate_up",
    "CohereForCausalLM": "parallel block, bias-free LayerNorm, per-head q/k norm, interleaved rope, logit_scale 0.5",
    "Cohere2ForCausalLM": "3 sliding (window 8, rope) + 1 global (no rope) layers, logit_scale 0.5",
    "InternLM3ForCausalLM": "Llama block via qkv_bias/bias config names (both on), head_dim 32",
    "MixtralForCausalLM": "8 experts, top-2 renormalized, GQA 4/2, sliding window 8",
    "Qwen2MoeForCausalLM": "8 experts top-2 (norm_topk_prob off) + sigmoid-gated shared expert, "
                           "layer 1 dense (mlp_only_layers), qkv bias",
    "Qwen3MoeForCausalLM": "8 experts top-3 (norm_topk_prob on), decoder_sparse_step 2 (layers 1, 3 sparse), "
                           "q/k RMSNorm",
}


def _base(vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


def _configs(vocab: int) -> dict:
    from transformers import (
        Cohere2Config,
        CohereConfig,
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        Glm4Config,
        GPT2Config,
        GraniteConfig,
        InternLM3Config,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Olmo2Config,
        Olmo3Config,
        OPTConfig,
        Phi3Config,
        PhiConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        StableLmConfig,
    )

    base = _base(vocab)
    ln = {k: v for k, v in base.items() if k != "rms_norm_eps"}  # LayerNorm families state their own eps
    opt = {"vocab_size": vocab, "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
           "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    return {
        # Llama 3.1 layout: GQA, llama3 rope scaling, untied head.
        "LlamaForCausalLM": LlamaConfig(**base, tie_word_embeddings=False, rope_theta=500000.0,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        # Sliding window shorter than prompt + output, so the window matters.
        "MistralForCausalLM": MistralConfig(**base, sliding_window=8, tie_word_embeddings=False),
        # qkv bias, tied embeddings.
        "Qwen2ForCausalLM": Qwen2Config(**base, tie_word_embeddings=True),
        # q/k norm, head_dim != hidden / heads.
        "Qwen3ForCausalLM": Qwen3Config(**{**base, "num_key_value_heads": 1}, head_dim=32, tie_word_embeddings=True),
        # Interleaved sliding/global layers with their own rope bases, soft-capped logits.
        "Gemma3ForCausalLM": Gemma3TextConfig(
            **{**base, "num_hidden_layers": 4}, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            final_logit_softcapping=30.0, rope_theta=1000000.0, rope_local_base_freq=10000.0),
        "GemmaForCausalLM": GemmaConfig(**{**base, "num_key_value_heads": 1}, head_dim=32, hidden_act="gelu"),
        "Gemma2ForCausalLM": Gemma2Config(**{**base, "num_hidden_layers": 4}, head_dim=32, sliding_window=8,
                                          query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                          final_logit_softcapping=10.0),
        "PhiForCausalLM": PhiConfig(**ln, partial_rotary_factor=0.5, qk_layernorm=True, layer_norm_eps=1e-5),
        "Phi3ForCausalLM": Phi3Config(
            **base, partial_rotary_factor=0.75, sliding_window=16, tie_word_embeddings=True,
            original_max_position_embeddings=4,  # every prompt is longer: the long factors throughout
            rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                          "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 12.0]}),
        # Not in ARCHITECTURES: LongRoPE's short factors under max_model_len <= 64 (tests/models/test_longrope.py)
        "Phi3ForCausalLM/short-rope": Phi3Config(
            **base, partial_rotary_factor=0.75, original_max_position_embeddings=64,
            rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                          "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 12.0]}),
        "OPTForCausalLM": OPTConfig(**opt),
        "OPTForCausalLM/post-norm": OPTConfig(**opt, do_layer_norm_before=False, word_embed_proj_dim=32),
        "GPT2LMHeadModel": GPT2Config(vocab_size=vocab, n_embd=64, n_layer=3, n_head=4, n_positions=256,
                                      bos_token_id=1, eos_token_id=2, scale_attn_by_inverse_layer_idx=True),
        "StableLmForCausalLM": StableLmConfig(**ln, partial_rotary_factor=0.25, use_qkv_bias=True, qk_layernorm=True),
        "StableLmForCausalLM/parallel": StableLmConfig(**ln, partial_rotary_factor=0.25, use_parallel_residual=True),
        "Olmo2ForCausalLM": Olmo2Config(**base),
        "Olmo3ForCausalLM": Olmo3Config(**{**base, "num_hidden_layers": 4}, sliding_window=8),
        "GraniteForCausalLM": GraniteConfig(**base, embedding_multiplier=12.0, attention_multiplier=0.1,
                                            residual_multiplier=0.22, logits_scaling=8.0),
        "Glm4ForCausalLM": Glm4Config(**base, head_dim=32, pad_token_id=0),
        "CohereForCausalLM": CohereConfig(**ln, use_qk_norm=True, logit_scale=0.5),
        "Cohere2ForCausalLM": Cohere2Config(**{**ln, "num_hidden_layers": 4}, sliding_window=8, logit_scale=0.5),
        "InternLM3ForCausalLM": InternLM3Config(**base, head_dim=32, qkv_bias=True, bias=True),
        # Sparse MoE: enough experts that routing differs token to token.
        "MixtralForCausalLM": MixtralConfig(**base, num_local_experts=8, num_experts_per_tok=2, sliding_window=8),
        "Qwen2MoeForCausalLM": Qwen2MoeConfig(**base, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=96, mlp_only_layers=[1]),
        "Qwen3MoeForCausalLM": Qwen3MoeConfig(**{**base, "num_hidden_layers": 4}, num_experts=8,
                                              num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
                                              decoder_sparse_step=2),
    }


def randomize(model: torch.nn.Module, one_plus_norms: bool = False) -> None:
    """Wider than the default init so logits are far from uniform; norms near 1 (near 0 where they scale
    by 1 + w); a routing bias that chooses (saved as zeros it would choose nothing)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = re.search(r"norm|\.ln_", name) is not None
            p.normal_(0.0, 0.3 if p.dim() == 1 or is_norm else 0.15)
            if is_norm and name.endswith("weight") and not one_plus_norms:
                p.add_(1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.2)


def make_tiny_checkpoint(arch: str, tokenizer_dir: str, out: Path,
                         make_config: Callable[[int], Any] | None = None) -> torch.nn.Module:
    """Save a random-weight `arch` with the tokenizer's files into `out`; return the transformers model.
    make_config(vocab_size) builds a config kept with its own test file instead of `_configs`' entry."""
    from transformers import AutoModelForCausalLM

    from vllmpy.tokenizer import Tokenizer

    vocab = Tokenizer.from_pretrained(tokenizer_dir).vocab_size
    config = make_config(vocab) if make_config else _configs(vocab)[arch]
    torch.manual_seed(0)
    config.architectures = [arch.split("/")[0]]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, one_plus_norms=arch in _ONE_PLUS_NORMS)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        src = f"{tokenizer_dir}/{name}"
        try:
            shutil.copy(src, out / name)
        except FileNotFoundError:
            pass
    return model
