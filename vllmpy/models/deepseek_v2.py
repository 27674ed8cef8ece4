"""DeepSeek-V2 / V3 (and Kimi K2, which is V3's architecture) and GLM-4.7-Flash (Glm4MoeLite): MLA
attention (attention/mla.py) with fine-grained MoE: routed experts (layers/moe_routing.py) plus
n_shared_experts always-on experts fused into one MLP of moe_intermediate_size * n_shared_experts.

Which layers are sparse: GLM-4.7-Flash's `mlp_layer_types`; else layer i >= first_k_dense_replace with
i % moe_layer_freq == 0 (vLLM's rule; transformers has no moe_layer_freq, i.e. 1). The others keep a
dense MLP of intermediate_size. V2 routes by softmax (greedy, or group_limited_greedy by the groups'
best expert); V3 by sigmoid with e_score_correction_bias and groups scored by their best two.
Checkpoints' MTP layers (`model.layers.{num_hidden_layers}..`) are skipped, or set aside for MTP
speculation (models/mtp.py).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from vllmpy.attention.mla import MultiHeadLatentAttention
from vllmpy.layers.linear import Linear
from vllmpy.layers.moe import FUSED_EXPERT_RENAMES, ExpertWeights, SparseMoE
from vllmpy.layers.moe_routing import Router, Routing
from vllmpy.layers.norm import RMSNorm
from vllmpy.models.base import CausalLM
from vllmpy.models.llama import DecoderLayer, DecoderModel, GatedMLP, norm_eps
from vllmpy.models.mtp import split_mtp_layers


def deepseek_routing(config: dict, scoring: str, grouped: bool, biased: bool, renormalize: bool) -> Routing:
    """The config's routing; `renormalize`: norm_topk_prob's default. Groups are scored by their best two
    experts where a correction bias chooses (V3), else by their best one (V2's group_limited_greedy)."""
    n_group = (config.get("n_group") or 1) if grouped else 1
    return Routing(num_experts=config["n_routed_experts"], top_k=config["num_experts_per_tok"],
                   scoring=config.get("scoring_func") or scoring, n_group=n_group,
                   topk_group=(config.get("topk_group") or n_group) if grouped else 1,
                   renormalize=bool(config.get("norm_topk_prob", renormalize)),
                   scaling_factor=float(config.get("routed_scaling_factor") or 1.0), group_by_top2=biased)


class DeepseekV2ForCausalLM(ExpertWeights, CausalLM):
    # Our fused gate_up and llama.cpp's kv_b_proj halves; no q_proj -> qkv_proj.
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                              "k_b_proj": ("kv_b_proj", "k_b"), "v_b_proj": ("kv_b_proj", "v_b")}
    checkpoint_renames = ((r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
                          (r"\.e_score_correction\.bias$", ".e_score_correction_bias"),  # llama.cpp's converter
                          *FUSED_EXPERT_RENAMES)
    default_first_dense = 0
    default_scoring = "softmax"
    mtp_weights: list | None = None  # a list: the loader sets the MTP blocks' tensors aside here (models/mtp.py)

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        n = config["num_hidden_layers"]
        layers = [DecoderLayer(config, MultiHeadLatentAttention(config),
                               self.make_moe(config) if self.is_sparse(config, i) else None) for i in range(n)]
        interleaved = bool(config.get("rope_interleave", True))
        self.model = DecoderModel(config, layers, RMSNorm(config["hidden_size"], norm_eps(config)),
                                  rope_interleaved=interleaved)
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"])
        self.tie_weights()

    def make_mtp_layer(self, config: dict) -> DecoderLayer:
        """The MTP block's decoder layer: layer num_hidden_layers by the sparse-layer rule (vLLM's)."""
        return DecoderLayer(config, MultiHeadLatentAttention(config),
                            self.make_moe(config) if self.is_sparse(config, config["num_hidden_layers"]) else None)

    def is_sparse(self, config: dict, layer: int) -> bool:
        if config.get("mlp_layer_types"):  # past its end: an MTP block, sparse as vLLM builds it
            types = config["mlp_layer_types"]
            return types[layer] == "sparse" if layer < len(types) else bool(config.get("n_routed_experts"))
        first_dense = config.get("first_k_dense_replace")
        first_dense = self.default_first_dense if first_dense is None else first_dense
        experts = config.get("n_routed_experts") or 0
        return experts > 0 and layer >= first_dense and layer % (config.get("moe_layer_freq") or 1) == 0

    def routing(self, config: dict) -> tuple[Routing, bool]:
        """The routing rule and whether the gate carries e_score_correction_bias: V2 by topk_method."""
        method = config.get("topk_method") or "greedy"
        return deepseek_routing(config, self.default_scoring, grouped=method in ("group_limited_greedy", "noaux_tc"),
                                biased=method == "noaux_tc", renormalize=False), method == "noaux_tc"

    def make_moe(self, config: dict) -> SparseMoE:
        """Routed experts plus the shared experts' MLP (moe_intermediate_size x n_shared_experts), ungated."""
        routing, bias = self.routing(config)
        hidden, act, inter = config["hidden_size"], config.get("hidden_act", "silu"), config["moe_intermediate_size"]
        shared = config.get("n_shared_experts") or 0
        return SparseMoE(hidden, inter, routing.num_experts, routing.top_k, act, routing.renormalize,
                         shared_expert=GatedMLP(hidden, inter * shared, act) if shared else None, gated_shared=False,
                         router=Router(hidden, routing, correction_bias=bias))

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_mtp_layers(weights, self.config["num_hidden_layers"], self.mtp_weights))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3's router whatever topk_method says (transformers' rule): sigmoid scores unless scoring_func
    says otherwise, e_score_correction_bias, n_group / topk_group groups scored by their best two."""

    default_first_dense = 3
    default_scoring = "sigmoid"

    def routing(self, config: dict) -> tuple[Routing, bool]:
        return deepseek_routing(config, self.default_scoring, grouped=True, biased=True, renormalize=True), True


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash: DeepSeek-V3's block as is; its first layer dense unless mlp_layer_types says otherwise."""

    default_first_dense = 1
