"""Mamba2 + attention hybrids: Granite 4.0-H (GraniteMoeHybrid) and Bamba.

Each layer of the shared hybrid decoder has a Mamba2 mixer (`mamba` in checkpoints) or attention
(`self_attn`), per the config's `layer_types` / `layers_block_type` (Granite) or `attn_layer_indices`
(Bamba); each keeps one cache in forward order (a seat's state or KV blocks). Granite adds its muP
scalars (embedding, residual, attention and logits multipliers), NoPE unless `position_embedding_type`
is "rope", and an MLP that is a shared gated MLP plus, when `num_local_experts` > 0, a routed MoE. Bamba
is the plain block: RoPE on half of each head, a gated MLP under `feed_forward`.
"""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.linear import Linear
from vllmpy.layers.mamba2 import Mamba2Mixer, time_step_limit
from vllmpy.layers.moe import ExpertWeights, SparseMoE
from vllmpy.layers.rotary import rope_parameters
from vllmpy.models.base import CausalLM
from vllmpy.models.hybrid import HybridDecoderLayer, HybridModel
from vllmpy.models.llama import Attention, GatedMLP, norm_eps

_MAMBA_KINDS = ("mamba", "linear_attention")
_ATTENTION_KINDS = ("attention", "full_attention")
_MAMBA_RENAME = (r"\.mamba\.", ".linear_attn.")  # the shared decoder's name for a recurrent mixer


def mamba_layers(config: dict) -> list[bool]:
    """Per layer: True for a Mamba2 mixer, False for attention."""
    n = config["num_hidden_layers"]
    if config.get("attn_layer_indices") is not None:  # Bamba
        return [i not in set(config["attn_layer_indices"]) for i in range(n)]
    kinds = config.get("layer_types") or config.get("layers_block_type") or ["mamba"] * n
    unknown = sorted(set(kinds) - set(_MAMBA_KINDS) - set(_ATTENTION_KINDS))
    if unknown or len(kinds) != n:
        raise UnsupportedCheckpointError(
            f"config layer_types {unknown or kinds} is not one mixer kind per layer ({n} layers) from "
            f"{', '.join(_MAMBA_KINDS + _ATTENTION_KINDS)}")
    return [kind in _MAMBA_KINDS for kind in kinds]


def mamba_mixer(config: dict) -> Mamba2Mixer:
    """The mixer from the `mamba_*` keys the Granite / Bamba / Nemotron-H configs share."""
    hidden, heads = config["hidden_size"], config["mamba_n_heads"]
    head_dim = config.get("mamba_d_head", "auto")
    if head_dim in (None, "auto"):
        head_dim = config.get("mamba_expand", 2) * hidden // heads
    return Mamba2Mixer(hidden, heads, head_dim, config.get("mamba_n_groups", 1), config.get("mamba_d_state", 256),
                       config.get("mamba_d_conv", 4), config.get("mamba_chunk_size", 256), norm_eps(config),
                       bias=bool(config.get("mamba_proj_bias", False)), conv_bias=bool(config.get("mamba_conv_bias", True)),
                       act=config.get("hidden_act", "silu"),
                       time_step_limit=time_step_limit(config))


class GraniteHybridMLP(nn.Module):
    """The shared gated MLP, plus the routed experts when the config has any."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, act = config["hidden_size"], config.get("hidden_act", "silu")
        self.shared = GatedMLP(hidden, config["shared_intermediate_size"], act)
        experts = config.get("num_local_experts") or 0
        self.moe = SparseMoE(hidden, config["intermediate_size"], experts, config["num_experts_per_tok"], act,
                             renormalize=True) if experts > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared(x)
        return out if self.moe is None else out + self.moe(x)


class GraniteMoeHybridForCausalLM(ExpertWeights, CausalLM):
    checkpoint_renames = (
        _MAMBA_RENAME,
        (r"\.block_sparse_moe\.(input_linear\.weight|experts\.gate_up_proj)$", ".mlp.moe.experts.gate_up_proj.weight"),
        (r"\.block_sparse_moe\.(output_linear\.weight|experts\.down_proj)$", ".mlp.moe.experts.down_proj.weight"),
        (r"\.block_sparse_moe\.router\.(layer\.)?weight$", ".mlp.moe.gate.weight"),
        (r"\.shared_mlp\.input_linear\.", ".mlp.shared.gate_up_proj."),
        (r"\.shared_mlp\.output_linear\.", ".mlp.shared.down_proj."),
    )

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        bias = bool(config.get("attention_bias", False))
        rope = config.get("position_embedding_type") == "rope"
        multiplier = config.get("residual_multiplier", 1.0)
        layers = [HybridDecoderLayer(config, mamba_mixer(config) if is_mamba else Attention(
            config, "full_attention", qkv_bias=bias, o_bias=bias, scale=config.get("attention_multiplier"),
            rope=rope), GraniteHybridMLP(config), residual_multiplier=multiplier) for is_mamba in mamba_layers(config)]
        self.model = HybridModel(config, layers, rope=rope,
                                 embedding_multiplier=config.get("embedding_multiplier", 1.0))
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"])
        self.logits_scaling = config.get("logits_scaling", 1.0)
        self.tie_weights()

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling


class BambaForCausalLM(CausalLM):
    checkpoint_renames = (
        _MAMBA_RENAME,
        (r"\.feed_forward\.", ".mlp."),
        (r"\.pre_ff_layernorm\.", ".post_attention_layernorm."),
        (r"^model\.final_layernorm\.", "model.norm."),
    )

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        config = dict(config)
        params = dict(rope_parameters(config))
        params.setdefault("partial_rotary_factor", 0.5)  # transformers hard-codes half-rotary Bamba
        config["rope_parameters"] = params
        bias, mlp_bias = bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))
        layers = [HybridDecoderLayer(config, mamba_mixer(config) if is_mamba else Attention(
            config, "full_attention", qkv_bias=bias, o_bias=bias),
            GatedMLP(config["hidden_size"], config["intermediate_size"], config.get("hidden_act", "silu"), mlp_bias))
            for is_mamba in mamba_layers(config)]
        self.model = HybridModel(config, layers)
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"])
        self.tie_weights()

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)
