"""Llama family: Llama 2/3/3.1 (rope scaling, tied or untied head) and Mistral (sliding window).

The blocks here are shared by every dense family; each knob names the families that turn it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vllmpy.attention.base import AttentionMetadata, AttentionSpec
from vllmpy.attention.layer import PagedAttention
from vllmpy.layers.activation import gated, get_activation
from vllmpy.layers.decode_replay import DecodeReplay
from vllmpy.layers.embedding import VocabEmbedding
from vllmpy.layers.linear import Linear, MergedLinear
from vllmpy.layers.norm import RMSNorm, add_norm
from vllmpy.layers.rotary import CosSin, RotaryEmbedding, apply_rotary_qk, rope_parameters, rotary_dim
from vllmpy.models.base import CausalLM

Norm = Callable[..., nn.Module]  # norm(shape, eps)


def norm_eps(config: dict, default: float = 1e-6) -> float:
    for key in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"):
        if config.get(key) is not None:
            return config[key]
    return default


def layer_types(config: dict, all_sliding: bool) -> list[str]:
    """Per-layer attention kind: the config's `layer_types`, else all sliding when the family says so."""
    n = config["num_hidden_layers"]
    if config.get("layer_types"):
        return list(config["layer_types"])
    kind = "sliding_attention" if all_sliding and config.get("sliding_window") else "full_attention"
    return [kind] * n


class Attention(nn.Module):
    """qkv -> [q/k norm] -> [rotary] -> paged attention -> o.

    qk_norm_layout: "shared" one [head_dim] weight for all heads (Qwen3, Gemma 3, Phi); "per_head" a
    [heads, head_dim] weight (Cohere, StableLM); "flat" one norm over the whole projection (OLMo 2).
    rope=False: no rotary (learned positions: GPT-2, OPT; Cohere 2's global layers).
    causal=False: bidirectional (encoders: BERT).
    clip_qkv: q, k and v clamped to [-clip, clip] after a flat q/k norm (OLMoE).
    sinks: a learned per-head logit in the softmax denominator (gpt-oss), `self_attn.sinks` in checkpoints.
    Layers of type "chunked_attention" see only their chunk of `attention_chunk_size` keys (Llama 4).
    """

    def __init__(self, config: dict, layer_type: str, qkv_bias: bool, o_bias: bool,
                 qk_norm: Norm | None = None, scale: float | None = None,
                 logit_soft_cap: float | None = None, qk_norm_layout: str = "shared", rope: bool = True,
                 causal: bool = True, clip_qkv: float | None = None, sinks: bool = False) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.clip_qkv = clip_qkv
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(hidden, {"q": q, "k": kv, "v": kv}, bias=qkv_bias)
        self.o_proj = Linear(q, hidden, bias=o_bias)
        eps = norm_eps(config)
        shapes = {"shared": (self.head_dim, self.head_dim), "flat": (q, kv),
                  "per_head": ((self.num_heads, self.head_dim), (self.num_kv_heads, self.head_dim))}[qk_norm_layout]
        self.q_norm = qk_norm(shapes[0], eps) if qk_norm else None
        self.k_norm = qk_norm(shapes[1], eps) if qk_norm else None
        self.qk_norm_flat = qk_norm_layout == "flat"
        self.layer_type = layer_type
        self.rope = rope
        window = config.get("sliding_window") if layer_type == "sliding_attention" else None
        chunk = config.get("attention_chunk_size") if layer_type == "chunked_attention" else None
        self.spec = AttentionSpec(self.num_heads, self.num_kv_heads, self.head_dim,
                                  scale=scale or self.head_dim ** -0.5, sliding_window=window,
                                  logit_soft_cap=logit_soft_cap, causal=causal, chunk_size=chunk)
        self.attn = PagedAttention(self.spec, sinks=sinks)

    def forward(self, x: torch.Tensor, cos_sin: CosSin | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        heads, kv_heads, head_dim, q_norm = self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm
        qkv = self.qkv_proj(x)
        if self.qk_norm_flat or self.clip_qkv is not None:  # on the flat projections (OLMo 2, OLMoE)
            q, k, v = self.qkv_proj.split(qkv)
            if q_norm is not None and self.qk_norm_flat:
                q, k = q_norm(q), self.k_norm(k)
            if self.clip_qkv is not None:
                q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
            q, k, v = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)
            q_norm = None
        else:  # views of the fused output's heads: one op (a split and three views cost ~6 us at decode)
            q, k, v = qkv.view(-1, heads + 2 * kv_heads, head_dim).split_with_sizes((heads, kv_heads, kv_heads), 1)
        if self.rope:  # the per-head norms go into rotary's pass
            q, k = apply_rotary_qk(q, k, cos_sin, *(() if q_norm is None else (q_norm, self.k_norm)))
        elif q_norm is not None:
            q, k = q_norm(q), self.k_norm(k)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(-1, heads * head_dim))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {0: intermediate, 1: intermediate}, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.act, self.gate_up_proj(x)))


class MLP(nn.Module):
    """fc2(act(fc1(x))): the ungated MLP (Phi, GPT-2, OPT)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = Linear(hidden, intermediate, bias=bias)
        self.fc2 = Linear(intermediate, hidden, bias=bias)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    parallel: x + attn(norm(x)) + mlp(norm(x)) with one norm (Phi, Cohere, StableLM's parallel variant).
    residual_multiplier scales each branch before it is added (Granite).
    """

    def __init__(self, config: dict, attention: Attention, mlp: nn.Module | None = None, norm: Norm = RMSNorm,
                 parallel: bool = False, residual_multiplier: float = 1.0) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], norm_eps(config)
        self.input_layernorm = norm(hidden, eps)
        self.self_attn = attention
        self.post_attention_layernorm = None if parallel else norm(hidden, eps)
        self.mlp = mlp or GatedMLP(hidden, config["intermediate_size"], config.get("hidden_act", "silu"),
                                   bias=bool(config.get("mlp_bias", False)))
        self.residual_multiplier = residual_multiplier

    def forward(self, x: torch.Tensor, cos_sin: CosSin | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.post_attention_layernorm is None:
            h = self.input_layernorm(x)
            return x + self.self_attn(h, cos_sin, kv_cache, meta) + self.mlp(h)
        m = self.residual_multiplier
        h = self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        if m == 1.0:  # the adds as kernel calls where the norms have them
            x, h = add_norm(x, h, None, self.post_attention_layernorm)
            return add_norm(x, self.mlp(h), None)[0]
        x = x + h * m
        return x + self.mlp(self.post_attention_layernorm(x)) * m


class SandwichDecoderLayer(nn.Module):
    """Norms on both sides of each branch: x + post(attn(pre(x))), then x + post(mlp(pre(x)))
    (Gemma 2/3, GLM-4). pre_norms=False keeps only the post norms (OLMo 2)."""

    def __init__(self, config: dict, attention: Attention, mlp: nn.Module, norm: Norm = RMSNorm,
                 pre_norms: bool = True) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], norm_eps(config)
        self.input_layernorm = norm(hidden, eps) if pre_norms else nn.Identity()
        self.self_attn = attention
        self.post_attention_layernorm = norm(hidden, eps)
        self.pre_feedforward_layernorm = norm(hidden, eps) if pre_norms else nn.Identity()
        self.mlp = mlp
        self.post_feedforward_layernorm = norm(hidden, eps)

    def forward(self, x: torch.Tensor, cos_sin: CosSin | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        x, h = add_norm(x, h, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        return add_norm(x, self.mlp(h), self.post_feedforward_layernorm)[0]


class DecoderModel(nn.Module):
    """Embedding, layers, final norm. One rotary per layer type that uses rope (they may use different bases).

    rope_interleaved: GPT-J pair layout (Cohere, GLM-4). learned_positions: rows of a learned position
    table added to the token embedding, read at position + position_offset (GPT-2: 0, OPT: 2).
    """

    def __init__(self, config: dict, layers: list[nn.Module], norm: nn.Module, rope_interleaved: bool = False,
                 learned_positions: int | None = None, position_offset: int = 0) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config["vocab_size"], config["hidden_size"])
        self.embed_positions = None
        if learned_positions:
            self.embed_positions = nn.Embedding(learned_positions, config["hidden_size"])
            self.embed_positions.weight.requires_grad_(False)
        self.position_offset = position_offset
        self.layers = nn.ModuleList(layers)
        self.decode_replay = DecodeReplay(self.layers)  # decode steps as their recorded kernel calls
        self.norm = norm
        head_dim = layers[0].self_attn.head_dim
        max_pos = config.get("max_position_embeddings", 4096)
        kinds = sorted({layer.self_attn.layer_type for layer in layers if layer.self_attn.rope})
        self.rotary = nn.ModuleDict({
            kind: RotaryEmbedding(rotary_dim(config, head_dim, kind), rope_parameters(config, kind), max_pos,
                                  rope_interleaved) for kind in kinds})

    def position_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        """Per layer type, what its attention gets for the positions: rope's cos/sin (Llama 4 gives its
        NoPE layers their query temperatures)."""
        return {kind: rotary.cos_sin(positions, dtype) for kind, rotary in self.rotary.items()}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: list[AttentionMetadata], inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """inputs_embeds: the embedded tokens when the caller built them (image rows spliced in)."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions + self.position_offset)
        x = self.decode_replay.run(self.run_layers, x, self.position_inputs(positions, x.dtype), kv_caches, meta)
        return self.norm(x)  # a replayed output is the plan's buffer: normed into a fresh tensor before it returns

    def run_layers(self, x: torch.Tensor, position_inputs: dict, kv_caches: list[torch.Tensor],
                   meta: list[AttentionMetadata]) -> torch.Tensor:
        for layer, kv_cache, layer_meta in zip(self.layers, kv_caches, meta):
            x = layer(x, position_inputs.get(layer.self_attn.layer_type), kv_cache, layer_meta)
        return x


class LlamaForCausalLM(CausalLM):
    all_sliding = False  # Mistral: every layer is sliding when sliding_window is set
    rope_interleaved = False  # GPT-J pair layout (ERNIE 4.5)

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        kinds = layer_types(config, self.all_sliding)
        layers = [DecoderLayer(config, self.make_attention(config, kind), self.make_mlp(config, i))
                  for i, kind in enumerate(kinds)]
        self.model = DecoderModel(config, layers, RMSNorm(config["hidden_size"], norm_eps(config)),
                                  rope_interleaved=self.rope_interleaved)
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"])
        self.tie_weights()

    def make_attention(self, config: dict, layer_type: str) -> Attention:
        bias = bool(config.get("attention_bias", False))
        return Attention(config, layer_type, qkv_bias=bias, o_bias=bias)

    def make_mlp(self, config: dict, layer_idx: int) -> nn.Module | None:
        """None: DecoderLayer's dense gated MLP (the MoE families return their sparse block)."""
        return None

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)


class MistralForCausalLM(LlamaForCausalLM):
    all_sliding = True
