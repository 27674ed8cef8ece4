"""Granite-MoE (Granite 3.x MoE): Granite's muP scalars with a sparse MoE in every layer. The router
takes the top-k logits and softmaxes over them (= softmax, top-k, renormalized). Checkpoints keep
each layer's experts as two stacks, `block_sparse_moe.input_linear` [E, 2I, H] (gate then up) and
`output_linear` [E, H, I], and the router as `router.layer`; llama.cpp's `granitemoe` GGUF splits the
first into per-projection stacks (ExpertWeights loads those)."""
from __future__ import annotations

from torch import nn

from vllmpy.layers.moe import ExpertWeights, SparseMoE
from vllmpy.models.granite import GraniteForCausalLM


class GraniteMoeForCausalLM(ExpertWeights, GraniteForCausalLM):
    checkpoint_renames = (
        (r"\.block_sparse_moe\.(input_linear\.weight|experts\.gate_up_proj)$", ".mlp.experts.gate_up_proj.weight"),
        (r"\.block_sparse_moe\.(output_linear\.weight|experts\.down_proj)$", ".mlp.experts.down_proj.weight"),
        (r"\.block_sparse_moe\.router\.(layer\.)?weight$", ".mlp.gate.weight"),
    )

    def make_mlp(self, config: dict) -> nn.Module:
        return SparseMoE(config["hidden_size"], config["intermediate_size"], config["num_local_experts"],
                         config["num_experts_per_tok"], config.get("hidden_act", "silu"), renormalize=True)
