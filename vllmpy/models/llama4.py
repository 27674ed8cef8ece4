"""Llama 4 (Scout, Maverick), text: the Llama block with rotary in the interleaved pair layout on
three of every four layers (`no_rope_layers[i] == 1`), which attend within chunks of
`attention_chunk_size` keys and L2-normalize q and k after rotary (`use_qk_norm`); the NoPE layers
attend globally with their queries scaled by a temperature that grows with the position,
log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1 (`attn_temperature_tuning`).

Layers in `moe_layers` are sparse: the router's top-k logits through a sigmoid are the weights, applied
to each expert's input (not its output), plus an ungated shared expert; the others are dense MLPs of
`intermediate_size_mlp`. transformers keeps the experts as [E, H, 2I] (`gate_up_proj`, gate then up)
and [E, I, H] (`down_proj`): loading transposes them to our [E, out, in] stacks.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from vllmpy.attention.base import AttentionMetadata
from vllmpy.layers.moe import FUSED_EXPERT_RENAMES, Experts, ExpertWeights, SparseMoE, in_out_expert_stacks
from vllmpy.layers.moe_routing import Router, Routing
from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import apply_rotary
from vllmpy.models.base import CausalLM
from vllmpy.models.llama import Attention, DecoderLayer, DecoderModel, GatedMLP, layer_types, norm_eps
from vllmpy.models.smollm3 import rope_layers


def moe_layers(config: dict) -> set[int]:
    if config.get("moe_layers") is not None:
        return set(config["moe_layers"])
    step = config.get("interleave_moe_layer_step", 1)
    return set(range(step - 1, config["num_hidden_layers"], step))


class Llama4Attention(Attention):
    """Rope layers: rotary, then the weightless L2 norm on q and k. NoPE layers: q times its temperature,
    which arrives in place of cos/sin (Llama4Model.position_inputs)."""

    def __init__(self, config: dict, layer_type: str, rope: bool) -> None:
        bias = bool(config.get("attention_bias", False))
        super().__init__(config, layer_type, qkv_bias=bias, o_bias=bias, rope=rope)
        self.l2_qk_norm = rope and bool(config.get("use_qk_norm", True))
        self.eps = norm_eps(config, 1e-5)

    def forward(self, x: torch.Tensor, rope_or_temperature, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.rope:
            q, k = apply_rotary(q, *rope_or_temperature), apply_rotary(k, *rope_or_temperature)
            if self.l2_qk_norm:
                q, k = (F.rms_norm(t.float(), (self.head_dim,), eps=self.eps).type_as(t) for t in (q, k))
        elif rope_or_temperature is not None:
            q = q * rope_or_temperature.to(q.dtype)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class Llama4Model(DecoderModel):
    temperature: tuple[float, float] | None = None  # (floor_scale, attn_scale) with attn_temperature_tuning

    def position_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        inputs = super().position_inputs(positions, dtype)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            inputs["full_attention"] = scales.view(-1, 1, 1)
        return inputs


class Llama4ForCausalLM(ExpertWeights, CausalLM):  # GGUF's per-projection stacks too
    checkpoint_renames = (
        (r"\.feed_forward\.router\.", ".mlp.gate."),
        (r"\.feed_forward\.", ".mlp."),
        *FUSED_EXPERT_RENAMES,
    )

    def __init__(self, config: dict) -> None:
        CausalLM.__init__(self, config)
        sparse = moe_layers(config)
        layers = [DecoderLayer(config, Llama4Attention(config, kind, rope), self.make_mlp(config, i in sparse))
                  for i, (kind, rope) in enumerate(zip(layer_types(config, all_sliding=False), rope_layers(config)))]
        temperature = ((config.get("floor_scale", 8192), config.get("attn_scale", 0.1))
                       if config.get("attn_temperature_tuning", True) else None)
        self.model = Llama4Model(config, layers, RMSNorm(config["hidden_size"], norm_eps(config, 1e-5)),
                                 rope_interleaved=True)
        self.model.temperature = temperature
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"])
        self.tie_weights()

    def make_mlp(self, config: dict, sparse: bool) -> nn.Module:
        hidden, act = config["hidden_size"], config.get("hidden_act", "silu")
        if not sparse:
            return GatedMLP(hidden, config["intermediate_size_mlp"], act)
        experts, inter = config["num_local_experts"], config["intermediate_size"]
        routing = Routing(experts, config["num_experts_per_tok"], "sigmoid")
        return SparseMoE(hidden, inter, experts, routing.top_k, act, renormalize=False,
                         shared_expert=GatedMLP(hidden, inter, act), gated_shared=False,
                         router=Router(hidden, routing, correction_bias=False),
                         experts=Experts(experts, hidden, inter, act, weights_on_inputs=True))

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(in_out_expert_stacks(weights))
