"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE).

A softmax router picks each token's top-k experts. The experts' weights are stacked ([E, 2I, H]
gate_up, [E, H, I] down), so the (token, expert) assignments are sorted by expert and each active
expert runs one matmul over all of its tokens: the Python loop is over experts, never tokens.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.activation import gated, get_activation
from vllmpy.layers.dense import dense_linear
from vllmpy.layers.linear import Linear, default_weight_loader, release
from vllmpy.layers.quantized import PackedTensor, packed_linear

ExpertShard = tuple[int, int | str]  # (expert, part of a fused projection)


class ExpertLinear(nn.Module):
    """One linear layer per expert, stacked: weight [E, out, in].

    Checkpoints store a 2D tensor per expert and part (`experts.3.gate_proj.weight`); the module's
    `weight_loader` copies it into that expert's rows for shard id (expert, part). Shard None is the
    whole stack (transformers' fused `experts.gate_up_proj`). Packed per-expert weights (quantized
    safetensors) stay packed: `load_packed` collects them and `finish_loading` fuses each expert's parts.
    """

    def __init__(self, num_experts: int, in_features: int, part_sizes: dict[int | str, int]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, sum(part_sizes.values()), in_features),
                                   requires_grad=False)
        self.shard_offsets: dict[ExpertShard, tuple[int, int]] = {}
        offset = 0
        for part, size in part_sizes.items():
            for expert in range(num_experts):
                self.shard_offsets[(expert, part)] = (offset, size)
            offset += size
        self.packed_parts: dict[ExpertShard, PackedTensor] = {}
        self.packed: list[list[PackedTensor]] | None = None  # per expert: its parts as fused segments

    def load_packed(self, weight: PackedTensor, shard_id: ExpertShard | None) -> None:
        if shard_id not in self.shard_offsets:
            raise ValueError(f"packed expert weight needs an (expert, part) shard, got {shard_id}")
        size = self.shard_offsets[shard_id][1]
        if weight.shape != (size, self.weight.shape[2]):
            raise ValueError(f"shape mismatch for expert shard {shard_id}: parameter {(size, self.weight.shape[2])} "
                             f"vs checkpoint {weight.shape}")
        self.packed_parts[shard_id] = weight

    def finish_loading(self) -> None:
        """Each expert's parts fused where they share a block type and column order; if some parts came
        dense, the packed ones are expanded into the stack instead."""
        if not self.packed_parts:
            return
        if len(self.packed_parts) < len(self.shard_offsets):
            for (expert, part), packed in self.packed_parts.items():
                offset, size = self.shard_offsets[(expert, part)]
                self.weight.data[expert].narrow(0, offset, size).copy_(packed.dequantize())
        else:
            self.packed = [[] for _ in range(self.weight.shape[0])]
            for shard in self.shard_offsets:  # each expert's parts in declared (row) order
                segments, part = self.packed[shard[0]], self.packed_parts[shard]
                if segments and segments[-1].fuses_with(part):
                    segments[-1] = segments[-1].concat(part)
                else:
                    segments.append(part)
            release(self.weight)
        self.packed_parts = {}

    def matmul(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x @ W_expert^T."""
        if self.packed is not None:
            return packed_linear(x, self.packed[expert])
        return dense_linear(x, self.weight[expert])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ExpertShard | None) -> None:
        if shard_id is None:
            default_weight_loader(param, loaded)
            return
        if shard_id not in self.shard_offsets:
            raise ValueError(f"expert shard {shard_id} is out of range for {param.shape[0]} experts")
        offset, size = self.shard_offsets[shard_id]
        target = param.data[shard_id[0]].narrow(0, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch for expert shard {shard_id}: parameter {tuple(target.shape)} "
                             f"vs checkpoint {tuple(loaded.shape)}")
        target.copy_(loaded)


class Experts(nn.Module):
    """E gated MLPs: down(act(gate(x)) * up(x)), with stacked weights."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = ExpertLinear(num_experts, hidden, {0: intermediate, 1: intermediate})
        self.down_proj = ExpertLinear(num_experts, intermediate, {0: hidden})
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights, ids [T, k]: out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # assignments grouped by expert
        rows = order // top_k  # the token of each assignment
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x[rows]
        out = torch.empty_like(xs)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            h = gated(self.act, self.gate_up_proj.matmul(expert, xs[start:end]))
            out[start:end] = self.down_proj.matmul(expert, h)
            start = end
        out *= weights.reshape(-1)[order].unsqueeze(1).to(out.dtype)
        return torch.zeros_like(x).index_add_(0, rows, out)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over experts (fp32), then the top-k; renormalize makes each token's k weights sum to 1
    (Mixtral always, Qwen when `norm_topk_prob`)."""
    weights, ids = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoE(nn.Module):
    """Routed experts, plus an always-on shared expert scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, act: str,
                 renormalize: bool, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise UnsupportedCheckpointError(
                f"config num_experts_per_tok={top_k} must be between 1 and the expert count {num_experts}")
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden, num_experts)
        self.experts = Experts(num_experts, hidden, intermediate, act)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(hidden, 1) if shared_expert is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


# transformers' fused expert tensors have no `.weight` suffix (`mlp.experts.gate_up_proj`).
FUSED_EXPERT_RENAMES = ((r"\.experts\.(gate_up_proj|down_proj)$", r".experts.\1.weight"),)
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")
_STACKED = re.compile(r"\.experts\.(gate_proj|up_proj|down_proj)\.weight$")


def expert_param(name: str, shard: int | str | None) -> tuple[str, ExpertShard | int | str | None]:
    """`experts.3.gate_up_proj.weight`, part 1 -> the stacked `experts.gate_up_proj.weight`, shard (3, 1)."""
    match = _PER_EXPERT.search(name)
    if match is None:
        return name, shard
    return f"{name[:match.start()]}.experts.{match[2]}.weight", (int(match[1]), 0 if shard is None else shard)


def unstack_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """llama.cpp stores one projection of every expert as a single [E, out, in] tensor
    (`experts.gate_proj.weight`); split it into the per-expert tensors HF checkpoints hold."""
    for name, tensor in weights:
        if _STACKED.search(name) is None:
            yield name, tensor
            continue
        for expert, part in enumerate(tensor.unbind(0)):
            yield name.replace(".experts.", f".experts.{expert}."), part


class ExpertWeights:
    """CausalLM mixin: per-expert (HF), fused (transformers) and stacked (GGUF) expert tensors all
    load into the stacked `Experts` parameters, through the base class's name mapping."""

    def checkpoint_name_to_param(self, name: str) -> tuple[str, ExpertShard | int | str | None]:
        return expert_param(*super().checkpoint_name_to_param(name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(unstack_experts(weights))
