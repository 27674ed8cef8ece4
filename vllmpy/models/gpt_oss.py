"""gpt-oss (20b, 120b): the Llama block with biases on q/k/v/o, a learned sink logit per head in every
attention softmax, sliding (window 128) and full layers alternating (`layer_types`), YaRN rope without
truncation, and a sparse MoE in every layer: a router with bias, top-k logits softmaxed (= softmax,
top-k, renormalized), experts with biases and a clamped SwiGLU, (up + 1) * g * sigmoid(alpha * g) with
g = min(gate, limit) and up clamped to +-limit.

transformers keeps each layer's experts as [E, H, 2I] with gate and up interleaved (`gate_up_proj`,
`gate_up_proj_bias`) and [E, I, H] (`down_proj`): loading transposes them to our [E, out, in] stacks
and puts the gate columns before the up ones.
"""
from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
from torch import nn

from vllmpy.layers.moe import (FUSED_EXPERT_RENAMES, Experts, ExpertWeights, SoftmaxRouter, SparseMoE,
                               in_out_expert_stacks)
from vllmpy.models.llama import Attention, LlamaForCausalLM


def clamped_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[N, 2I] gate | up halves -> [N, I]."""
    gate, up = h.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


class GptOssForCausalLM(ExpertWeights, LlamaForCausalLM):  # per-expert names: MXFP4 and GGUF stacks, packed
    checkpoint_renames = (
        (r"\.self_attn\.sinks$", ".self_attn.attn.sinks"),
        (r"\.mlp\.router\.", ".mlp.gate."),
        *FUSED_EXPERT_RENAMES,
        (r"\.experts\.(gate_up_proj|down_proj)_bias$", r".experts.\1.bias"),
    )

    def make_attention(self, config: dict, layer_type: str) -> Attention:
        bias = bool(config.get("attention_bias", True))
        return Attention(config, layer_type, qkv_bias=bias, o_bias=bias, sinks=True)

    def make_mlp(self, config: dict, layer_idx: int) -> nn.Module:
        hidden, inter, experts = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
        top_k = config["num_experts_per_tok"]
        glu = partial(clamped_swiglu, alpha=config.get("swiglu_alpha", 1.702), limit=config.get("swiglu_limit", 7.0))
        return SparseMoE(hidden, inter, experts, top_k, "silu", renormalize=True,
                         router=SoftmaxRouter(hidden, experts, top_k, renormalize=True, bias=True),
                         experts=Experts(experts, hidden, inter, "silu", bias=True, glu=glu))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(in_out_expert_stacks(weights, interleaved=True))
