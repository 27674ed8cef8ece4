"""Mixtral: Mistral's block (GQA, sliding window when set) with a sparse MoE in place of the MLP.

Each token's router softmax picks `num_experts_per_tok` of `num_local_experts` experts, and their
weights are renormalized to sum to 1. Checkpoints name the block `block_sparse_moe` and each expert's
projections w1 (gate), w3 (up), w2 (down).
"""
from __future__ import annotations

from torch import nn

from vllmpy.layers.moe import FUSED_EXPERT_RENAMES, ExpertWeights, SparseMoE
from vllmpy.models.llama import MistralForCausalLM


class MixtralForCausalLM(ExpertWeights, MistralForCausalLM):
    checkpoint_renames = (
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"\.w1\.", ".gate_proj."), (r"\.w3\.", ".up_proj."), (r"\.w2\.", ".down_proj."),
        *FUSED_EXPERT_RENAMES,
    )

    def make_mlp(self, config: dict, layer_idx: int) -> nn.Module:
        return SparseMoE(config["hidden_size"], config["intermediate_size"], config["num_local_experts"],
                         config["num_experts_per_tok"], config.get("hidden_act", "silu"), renormalize=True)
