"""Llama family: Llama 2/3/3.1 (rope scaling, tied or untied head) and Mistral (sliding window).

Qwen2 (qkv bias) and Qwen3 (q/k norm) reuse these blocks with their own knobs.
"""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.attention.base import AttentionMetadata, AttentionSpec
from vllmpy.attention.torch_paged import paged_attention
from vllmpy.layers.activation import gated, get_activation
from vllmpy.layers.linear import Linear, MergedLinear
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from vllmpy.models.base import CausalLM


def layer_types(config: dict, all_sliding: bool) -> list[str]:
    """Per-layer attention kind: the config's `layer_types`, else all sliding when the family says so."""
    n = config["num_hidden_layers"]
    if config.get("layer_types"):
        return list(config["layer_types"])
    kind = "sliding_attention" if all_sliding and config.get("sliding_window") else "full_attention"
    return [kind] * n


class Attention(nn.Module):
    def __init__(self, config: dict, layer_type: str, qkv_bias: bool, o_bias: bool,
                 qk_norm: type[nn.Module] | None = None, scale: float | None = None,
                 logit_soft_cap: float | None = None) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(hidden, {"q": q, "k": kv, "v": kv}, bias=qkv_bias)
        self.o_proj = Linear(q, hidden, bias=o_bias)
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = qk_norm(self.head_dim, eps) if qk_norm else None
        self.k_norm = qk_norm(self.head_dim, eps) if qk_norm else None
        self.layer_type = layer_type
        window = config.get("sliding_window") if layer_type == "sliding_attention" else None
        self.spec = AttentionSpec(self.num_heads, self.num_kv_heads, self.head_dim,
                                  scale=scale or self.head_dim ** -0.5, sliding_window=window,
                                  logit_soft_cap=logit_soft_cap)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        out = paged_attention(q, k, v, kv_cache, meta, self.spec)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {0: intermediate, 1: intermediate}, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.act, self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: dict, attention: Attention) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)
        self.mlp = GatedMLP(config["hidden_size"], config["intermediate_size"],
                            config.get("hidden_act", "silu"), bias=bool(config.get("mlp_bias", False)))

    def forward(self, x: torch.Tensor, cos_sin, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embedding, layers, final norm. One rotary per layer type (they may use different bases)."""

    def __init__(self, config: dict, layers: list[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        head_dim = layers[0].self_attn.head_dim
        rotary_dim = int(head_dim * config.get("partial_rotary_factor", 1.0))
        max_pos = config.get("max_position_embeddings", 4096)
        kinds = sorted({layer.self_attn.layer_type for layer in layers})
        self.rotary = nn.ModuleDict({
            kind: RotaryEmbedding(rotary_dim, rope_parameters(config, kind), max_pos) for kind in kinds})

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        cos_sin = {kind: rotary.cos_sin(positions, x.dtype) for kind, rotary in self.rotary.items()}
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos_sin[layer.self_attn.layer_type], kv_cache, meta)
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    all_sliding = False  # Mistral: every layer is sliding when sliding_window is set

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        kinds = layer_types(config, self.all_sliding)
        layers = [DecoderLayer(config, self.make_attention(config, kind)) for kind in kinds]
        self.model = DecoderModel(config, layers, RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6)))
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"])
        self.tie_weights()

    def make_attention(self, config: dict, layer_type: str) -> Attention:
        bias = bool(config.get("attention_bias", False))
        return Attention(config, layer_type, qkv_bias=bias, o_bias=bias)

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)


class MistralForCausalLM(LlamaForCausalLM):
    all_sliding = True
