"""OLMoE: the Llama block with RMSNorm on q and k over the whole projection (as OLMo 2), q/k/v
clamped to +-clip_qkv when set, and a sparse MoE in every layer (softmax top-k, renormalized only
with `norm_topk_prob`, experts of `intermediate_size`, no shared expert)."""
from __future__ import annotations

from torch import nn

from vllmpy.layers.moe import FUSED_EXPERT_RENAMES, ExpertWeights, SparseMoE
from vllmpy.layers.norm import RMSNorm
from vllmpy.models.llama import Attention, LlamaForCausalLM
from vllmpy.models.qwen2_moe import num_experts


class OlmoeForCausalLM(ExpertWeights, LlamaForCausalLM):
    all_sliding = True  # transformers applies `sliding_window`, when set, to every layer
    checkpoint_renames = FUSED_EXPERT_RENAMES

    def make_attention(self, config: dict, layer_type: str) -> Attention:
        bias = bool(config.get("attention_bias", False))
        return Attention(config, layer_type, qkv_bias=bias, o_bias=bias, qk_norm=RMSNorm, qk_norm_layout="flat",
                         clip_qkv=config.get("clip_qkv"))

    def make_mlp(self, config: dict, layer_idx: int) -> nn.Module:
        return SparseMoE(config["hidden_size"], config["intermediate_size"], num_experts(config),
                         config["num_experts_per_tok"], config.get("hidden_act", "silu"),
                         renormalize=bool(config.get("norm_topk_prob", False)))
