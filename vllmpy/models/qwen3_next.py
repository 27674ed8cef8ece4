"""Qwen3-Next and Qwen3.5 (dense, MoE; the language model of the vision-language checkpoints, models/qwen3_5_vl.py).

Hybrids: most layers are Gated DeltaNet (`linear_attention`), every few a gated full attention
(`layer_types`, else every `full_attention_interval`-th). All norms are zero-centred (x (1 + w)) except
the GDN output norm. Attention: q_proj yields q and a per-head output gate (out * sigmoid(gate)), q/k
RMSNorm per head, partial rotary (`partial_rotary_factor`, 0.25). MLPs: Qwen3-Next's sparse layers and
Qwen3.5-MoE's every layer route softmax top-k experts plus a sigmoid-gated shared expert; Qwen3.5 dense
is a gated MLP. Qwen3-Next's GDN projections are interleaved per key head (in_proj_qkvz, in_proj_ba);
Qwen3.5 splits them (in_proj_qkv, _z, _b, _a).
"""
from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch
from torch import nn

from vllmpy.attention.base import AttentionMetadata
from vllmpy.layers.gated_delta_net import GatedDeltaNet
from vllmpy.layers.linear import Linear, MergedLinear
from vllmpy.layers.moe import FUSED_EXPERT_RENAMES, ExpertWeights, SparseMoE
from vllmpy.layers.norm import GemmaRMSNorm
from vllmpy.layers.rotary import CosSin, apply_rotary
from vllmpy.models.base import CausalLM
from vllmpy.models.hybrid import HybridDecoderLayer, HybridModel
from vllmpy.models.llama import Attention, GatedMLP, norm_eps
from vllmpy.models.qwen2_moe import is_sparse_layer, num_experts

logger = logging.getLogger("vllmpy")

LINEAR, FULL = "linear_attention", "full_attention"


def hybrid_layer_types(config: dict) -> list[str]:
    """`layer_types`, else linear with every `full_attention_interval`-th layer (default 4) full."""
    if config.get("layer_types"):
        return list(config["layer_types"])
    interval = config.get("full_attention_interval") or 4
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(config["num_hidden_layers"])]


class GatedAttention(Attention):
    """Attention whose q_proj also yields a per-head output gate: [q_h | gate_h] for each head h."""

    def __init__(self, config: dict) -> None:
        super().__init__(config, FULL, qkv_bias=bool(config.get("attention_bias", False)),
                         o_bias=bool(config.get("attention_bias", False)), qk_norm=GemmaRMSNorm)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config["hidden_size"], {"q": 2 * q, "k": kv, "v": kv},
                                     bias=bool(config.get("attention_bias", False)))

    def forward(self, x: torch.Tensor, cos_sin: CosSin, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, gate = q_gate.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q), *cos_sin)
        k = apply_rotary(self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim)), *cos_sin)
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), kv_cache, meta)
        out = out.reshape(-1, self.num_heads * self.head_dim) * torch.sigmoid(gate.reshape(out.shape[0], -1))
        return self.o_proj(out)


class InterleavedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's projections: per key head [q | k | v (r heads) | z (r heads)] and [b (r) | a (r)],
    r = num_v_heads / num_k_heads; regrouped into Qwen3.5's [q | k | v], z, b, a at run time."""

    def make_projections(self, hidden: int) -> None:
        self.in_proj_qkvz = Linear(hidden, 2 * self.key_dim + 2 * self.value_dim)
        self.in_proj_ba = Linear(hidden, 2 * self.num_v_heads)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, heads, r = x.shape[0], self.num_k_heads, self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(tokens, heads, -1)
        q, k, v, z = qkvz.split([self.k_dim, self.k_dim, r * self.v_dim, r * self.v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(tokens, heads, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat((q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)), dim=-1)
        return qkv, z.reshape(tokens, -1), b.reshape(tokens, -1), a.reshape(tokens, -1)


class Qwen3NextForCausalLM(ExpertWeights, CausalLM):
    packed_modules_mapping = {
        **CausalLM.packed_modules_mapping,
        "in_proj_qkv": ("in_proj", "qkv"), "in_proj_z": ("in_proj", "z"),
        "in_proj_b": ("in_proj", "b"), "in_proj_a": ("in_proj", "a"),
    }
    checkpoint_renames = FUSED_EXPERT_RENAMES
    gdn_class: type[GatedDeltaNet] = InterleavedGatedDeltaNet

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        eps = norm_eps(config)
        layers = [HybridDecoderLayer(config, self.gdn_class(config, eps) if kind == LINEAR else GatedAttention(config),
                                     self.make_mlp(config, i), GemmaRMSNorm)
                  for i, kind in enumerate(hybrid_layer_types(config))]
        self.model = HybridModel(config, layers, GemmaRMSNorm)
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"])
        self.tie_weights()

    def make_mlp(self, config: dict, layer_idx: int) -> nn.Module:
        """Sparse where Qwen2-MoE's rule says (decoder_sparse_step, mlp_only_layers), else dense."""
        hidden, act = config["hidden_size"], config.get("hidden_act", "silu")
        if not is_sparse_layer(config, layer_idx):
            return GatedMLP(hidden, config["intermediate_size"], act)
        return SparseMoE(hidden, config["moe_intermediate_size"], num_experts(config), config["num_experts_per_tok"],
                         act, renormalize=self.renormalize(config),
                         shared_expert=GatedMLP(hidden, config["shared_expert_intermediate_size"], act))

    def renormalize(self, config: dict) -> bool:
        return bool(config.get("norm_topk_prob", True))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(without_extra_heads(weights, keep_vision=hasattr(self, "visual")))

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    gdn_class = GatedDeltaNet

    def make_mlp(self, config: dict, layer_idx: int) -> nn.Module:
        return GatedMLP(config["hidden_size"], config["intermediate_size"], config.get("hidden_act", "silu"))


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Every layer sparse; the router always renormalizes its top-k."""

    gdn_class = GatedDeltaNet

    def __init__(self, config: dict) -> None:
        super().__init__({**config, "decoder_sparse_step": 1, "mlp_only_layers": []})

    def renormalize(self, config: dict) -> bool:
        return True


def without_extra_heads(weights: Iterable[tuple[str, torch.Tensor]],
                        keep_vision: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors less the multi-token-prediction head (`mtp.*`, unused without speculative
    decoding) and, for a text-only architecture, a vision tower (`model.visual.*`, skipped with one INFO
    line: the checkpoint's *ForConditionalGeneration architecture serves its images, models/qwen3_5_vl.py)."""
    skipped = 0
    for name, tensor in weights:
        if name.startswith("mtp."):
            continue
        if name.startswith("model.visual.") and not keep_vision:
            skipped += 1
            continue
        yield name, tensor
    if skipped:
        logger.info("vision tower skipped: %d model.visual.* tensors not loaded; this architecture serves text only",
                    skipped)
