"""ERNIE-4.5-MoE (21B-A3B, 300B-A47B): the Llama block with rotary in the interleaved pair layout,
`use_bias` on every projection (the LM head's too), and sparse layers where (i + 1) % moe_layer_interval == 0 between
moe_layer_start_index and moe_layer_end_index. The router softmaxes in fp32, chooses the top-k by
score + `e_score_correction_bias` (checkpoint `mlp.moe_statics.e_score_correction_bias`, [1, E]),
weights the chosen experts by their unbiased scores renormalized, and adds the shared experts
(moe_num_shared_experts of moe_intermediate_size, fused into one MLP) ungated."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from vllmpy.layers.linear import Linear
from vllmpy.layers.moe import FUSED_EXPERT_RENAMES, ExpertWeights, SparseMoE
from vllmpy.layers.moe_routing import Router, Routing
from vllmpy.models.llama import Attention, GatedMLP, LlamaForCausalLM


def is_sparse_layer(config: dict, layer_idx: int) -> bool:
    end = config.get("moe_layer_end_index", -1)
    end = config["num_hidden_layers"] - 1 if end in (-1, None) else end
    return ((layer_idx + 1) % (config.get("moe_layer_interval") or 1) == 0
            and (config.get("moe_layer_start_index") or 0) <= layer_idx <= end)


def _flat_correction_bias(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's [1, E] correction bias (one expert group) as the router's [E]."""
    for name, tensor in weights:
        yield name, tensor.reshape(-1) if name.endswith("e_score_correction_bias") else tensor


class Ernie4_5_MoeForCausalLM(ExpertWeights, LlamaForCausalLM):
    rope_interleaved = True
    checkpoint_renames = (
        (r"\.mlp\.(gate\.)?moe_statics\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
        *FUSED_EXPERT_RENAMES,
    )

    def __init__(self, config: dict) -> None:
        bias = bool(config.get("use_bias", False))
        super().__init__({**config, "mlp_bias": bias})
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"], bias=bias)  # the head has one too
        self.tie_weights()

    def make_attention(self, config: dict, layer_type: str) -> Attention:
        bias = bool(config.get("use_bias", False))
        return Attention(config, layer_type, qkv_bias=bias, o_bias=bias)

    def make_mlp(self, config: dict, layer_idx: int) -> nn.Module | None:
        if not is_sparse_layer(config, layer_idx):
            return None
        hidden, act, inter = config["hidden_size"], config.get("hidden_act", "silu"), config["moe_intermediate_size"]
        experts, shared = config.get("moe_num_experts") or config["num_experts"], config.get("moe_num_shared_experts")
        routing = Routing(experts, config.get("moe_k") or config["num_experts_per_tok"], "softmax", renormalize=True)
        shared_mlp = GatedMLP(hidden, inter * shared, act, bias=config["mlp_bias"]) if shared else None
        return SparseMoE(hidden, inter, experts, routing.top_k, act, renormalize=True, shared_expert=shared_mlp,
                         gated_shared=False, router=Router(hidden, routing, correction_bias=True))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_flat_correction_bias(weights))
