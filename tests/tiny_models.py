"""Tiny random-weight checkpoints of each architecture, saved by transformers with a real tokenizer."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Gemma3ForCausalLM"]


def _base(vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


def _configs(vocab: int) -> dict:
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    base = _base(vocab)
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
    }


def make_tiny_checkpoint(arch: str, tokenizer_dir: str, out: Path) -> torch.nn.Module:
    """Save a random-weight `arch` with the tokenizer's files into `out`; return the transformers model."""
    from transformers import AutoModelForCausalLM

    from vllmpy.tokenizer import Tokenizer

    config = _configs(Tokenizer.from_pretrained(tokenizer_dir).vocab_size)[arch]
    torch.manual_seed(0)
    config.architectures = [arch]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # wider than the default init so logits are far from uniform
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.15 if p.dim() > 1 else 0.3)
            if p.dim() == 1 and "norm" in name and arch != "Gemma3ForCausalLM":
                p.add_(1.0)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        src = f"{tokenizer_dir}/{name}"
        try:
            shutil.copy(src, out / name)
        except FileNotFoundError:
            pass
    return model
