"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's block (qkv bias) with sparse MoE layers.

Layer i is sparse when it is not in `mlp_only_layers` and (i + 1) is a multiple of
`decoder_sparse_step`; the others keep a dense MLP of `intermediate_size`. A sparse layer routes each
token to `num_experts_per_tok` of `num_experts` experts (softmax, top-k, renormalized only with
`norm_topk_prob`) and adds a shared expert gated by sigmoid(shared_expert_gate(x)).
"""
from __future__ import annotations

from torch import nn

from vllmpy.layers.moe import FUSED_EXPERT_RENAMES, ExpertWeights, SparseMoE
from vllmpy.models.llama import Attention, GatedMLP, LlamaForCausalLM


def num_experts(config: dict) -> int:
    """transformers 5 saves Qwen3-MoE's `num_experts` under its alias `num_local_experts`."""
    return config.get("num_experts") or config.get("num_local_experts") or 0


def is_sparse_layer(config: dict, layer_idx: int) -> bool:
    step = config.get("decoder_sparse_step") or 1
    return (num_experts(config) > 0 and layer_idx not in (config.get("mlp_only_layers") or [])
            and (layer_idx + 1) % step == 0)


class Qwen2MoeForCausalLM(ExpertWeights, LlamaForCausalLM):
    checkpoint_renames = FUSED_EXPERT_RENAMES

    def make_attention(self, config: dict, layer_type: str) -> Attention:
        return Attention(config, layer_type, qkv_bias=bool(config.get("qkv_bias", True)), o_bias=False)

    def make_mlp(self, config: dict, layer_idx: int) -> nn.Module | None:
        if not is_sparse_layer(config, layer_idx):
            return None
        hidden, act = config["hidden_size"], config.get("hidden_act", "silu")
        shared = config.get("shared_expert_intermediate_size")
        return SparseMoE(hidden, config["moe_intermediate_size"], num_experts(config), config["num_experts_per_tok"],
                         act, renormalize=bool(config.get("norm_topk_prob", False)),
                         shared_expert=GatedMLP(hidden, shared, act) if shared else None)
