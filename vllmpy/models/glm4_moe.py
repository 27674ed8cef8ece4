"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): the Llama block (pre-norms, neox rotary on half of each
head, q/k/v bias with `attention_bias`, per-head q/k RMSNorm with `use_qk_norm`) with DeepSeek-V3's
MoE from layer `first_k_dense_replace` on: sigmoid scores, e_score_correction_bias to choose, groups
scored by their best two, norm_topk_prob, routed_scaling_factor, and n_shared_experts added ungated.
The checkpoint's MTP layers (`model.layers.{num_hidden_layers}..`) are skipped, or set aside for MTP
speculation (models/mtp.py)."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllmpy.layers.moe import FUSED_EXPERT_RENAMES, ExpertWeights, SparseMoE
from vllmpy.layers.moe_routing import Router, Routing
from vllmpy.layers.norm import RMSNorm
from vllmpy.models.glm4 import with_half_rotary
from vllmpy.models.llama import Attention, DecoderLayer, GatedMLP, LlamaForCausalLM
from vllmpy.models.mtp import split_mtp_layers


def routing(config: dict) -> Routing:
    n_group = config.get("n_group") or 1
    return Routing(num_experts=config.get("n_routed_experts") or config["num_local_experts"],
                   top_k=config["num_experts_per_tok"], scoring="sigmoid", n_group=n_group,
                   topk_group=config.get("topk_group") or n_group,
                   renormalize=bool(config.get("norm_topk_prob", True)),
                   scaling_factor=float(config.get("routed_scaling_factor") or 1.0), group_by_top2=True)


class Glm4MoeForCausalLM(ExpertWeights, LlamaForCausalLM):
    checkpoint_renames = ((r"\.mlp\.shared_experts\.", ".mlp.shared_expert."), *FUSED_EXPERT_RENAMES)
    mtp_weights: list | None = None  # a list: the loader sets the MTP blocks' tensors aside here (models/mtp.py)

    def __init__(self, config: dict) -> None:
        super().__init__(with_half_rotary(config))

    def make_attention(self, config: dict, layer_type: str) -> Attention:
        return Attention(config, layer_type, qkv_bias=bool(config.get("attention_bias", False)), o_bias=False,
                         qk_norm=RMSNorm if config.get("use_qk_norm") else None)

    def make_mlp(self, config: dict, layer_idx: int) -> nn.Module | None:
        if layer_idx < config.get("first_k_dense_replace", 1):
            return None
        hidden, act, inter = config["hidden_size"], config.get("hidden_act", "silu"), config["moe_intermediate_size"]
        route = routing(config)
        shared = config.get("n_shared_experts") or 0
        return SparseMoE(hidden, inter, route.num_experts, route.top_k, act, renormalize=route.renormalize,
                         shared_expert=GatedMLP(hidden, inter * shared, act) if shared else None, gated_shared=False,
                         router=Router(hidden, route, correction_bias=True))

    def make_mtp_layer(self, config: dict) -> DecoderLayer:
        """The MTP block's decoder layer: a full-attention layer at index num_hidden_layers (sparse)."""
        n = config["num_hidden_layers"]
        return DecoderLayer(config, self.make_attention(config, "full_attention"), self.make_mlp(config, n))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_mtp_layers(weights, self.config["num_hidden_layers"], self.mtp_weights))
