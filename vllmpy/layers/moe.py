"""Sparse mixture-of-experts MLP (Mixtral, Qwen-MoE, OLMoE, Granite-MoE, ERNIE-4.5, gpt-oss, Llama 4, ...).

A router picks each token's top-k experts. The experts' weights are stacked ([E, 2I, H] gate_up,
[E, H, I] down), so the (token, expert) assignments are sorted by expert; then each projection is
either one grouped matmul over all of them (`torch._grouped_mm`, segment offsets on the device: no
host sync; CUDA, and CPU batches of a few rows per expert) or one matmul per active expert over all
of its rows (larger CPU batches, and packed GGML / quantized stacks, which stay packed): never a loop
per token.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.activation import gated, get_activation
from vllmpy.layers.dense import dense_linear
from vllmpy.layers.linear import Linear, default_weight_loader, release
from vllmpy.layers.packed_experts import PackedExperts, takes_rows
from vllmpy.layers.quantized import PackedTensor, packed_linear

ExpertShard = tuple[int, int | str]  # (expert, part of a fused projection)
Glu = Callable[[torch.Tensor], torch.Tensor]  # [N, 2I] gate and up halves -> [N, I]
# torch's grouped matmul serves these dtypes on CPU (and bf16 on recent CUDA); float32 rows equal F.linear's.
_GROUPED_MM = hasattr(torch, "_grouped_mm")
_GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}
# On CPU, above this many assignments per expert the per-expert oneDNN matmuls beat torch's grouped
# kernel (64 experts top-6, hidden 512, one thread on the shared 2-core dev host: grouped 1.9x faster at
# 16 tokens, 0.7x at 512; benchmarks/moe_layer.py). CUDA always groups (no host sync, one launch).
_CPU_GROUPED_ROWS_PER_EXPERT = 2


class ExpertLinear(nn.Module):
    """One linear layer per expert, stacked: weight [E, out, in].

    Checkpoints store a 2D tensor per expert and part (`experts.3.gate_proj.weight`); the module's
    `weight_loader` copies it into that expert's rows for shard id (expert, part). Shard None is the
    whole stack (transformers' fused `experts.gate_up_proj`). Packed per-expert weights (quantized
    safetensors) stay packed: `load_packed` collects them and `finish_loading` fuses each expert's parts.
    """

    def __init__(self, num_experts: int, in_features: int, part_sizes: dict[int | str, int],
                 bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, sum(part_sizes.values()), in_features),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(num_experts, sum(part_sizes.values())), requires_grad=False)
                     if bias else None)  # gpt-oss: one bias row per expert, loaded whole
        self.shard_offsets: dict[ExpertShard, tuple[int, int]] = {}
        offset = 0
        for part, size in part_sizes.items():
            for expert in range(num_experts):
                self.shard_offsets[(expert, part)] = (offset, size)
            offset += size
        self.packed_parts: dict[ExpertShard, PackedTensor] = {}
        self.packed: list[list[PackedTensor]] | None = None  # per expert: its parts as fused segments
        self.packed_experts: PackedExperts | None = None  # `packed` as one decode call's table, where it can be

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
            self.packed_experts = None if self.bias is not None else PackedExperts.build(self.packed)
        self.packed_parts = {}

    def matmul(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x @ W_expert^T (+ b_expert)."""
        bias = None if self.bias is None else self.bias[expert]
        if self.packed is not None:
            return packed_linear(x, self.packed[expert], bias)
        return dense_linear(x, self.weight[expert], bias)

    def groups_in_one_call(self, x: torch.Tensor) -> bool:
        """Whether grouped_matmul serves x: a dense stack of x's dtype on a device torch groups on."""
        return (_GROUPED_MM and self.packed is None and self.weight.dtype == x.dtype
                and x.dtype in _GROUPED_DTYPES.get(x.device.type, ()))

    def grouped_matmul(self, x: torch.Tensor, ends: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Rows of x sorted by expert, expert e's rows ending at ends[e] (int32): row @ W_e^T (+ b_e).
        experts: each row's expert (for the bias)."""
        y = torch._grouped_mm(x, self.weight.transpose(1, 2), offs=ends)
        return y if self.bias is None else y + self.bias[experts]

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
    """E gated MLPs: down(glu(gate_up(x))), glu = act(gate) * up unless a family gives its own (gpt-oss's
    clamped SwiGLU); bias=True gives each projection a bias per expert (gpt-oss). weights_on_inputs:
    each expert gets its routing weight times x instead of its output scaled (Llama 4)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str, bias: bool = False,
                 glu: Glu | None = None, weights_on_inputs: bool = False) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.weights_on_inputs = weights_on_inputs
        self.gate_up_proj = ExpertLinear(num_experts, hidden, {0: intermediate, 1: intermediate}, bias)
        self.down_proj = ExpertLinear(num_experts, intermediate, {0: hidden}, bias)
        self.act = get_activation(act)
        self.glu = glu or (lambda h: gated(self.act, h))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights, ids [T, k]: out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])
        (or expert_{ids[t, j]}(weights[t, j] * x[t]) with weights_on_inputs)."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # assignments grouped by expert
        rows = order // top_k  # the token of each assignment
        counts = torch.bincount(flat, minlength=self.num_experts)
        xs = x[rows]
        scale = weights.reshape(-1)[order].unsqueeze(1).to(x.dtype)
        if self.weights_on_inputs:
            xs = xs * scale
        if self._grouped(xs):
            ends, experts = counts.cumsum(0).to(torch.int32), flat[order]
            h = self.glu(self.gate_up_proj.grouped_matmul(xs, ends, experts))
            out = self.down_proj.grouped_matmul(h, ends, experts)
        else:
            out = self._packed_in_one_call(xs, counts)
            if out is None:
                out = self._per_expert(xs, counts.tolist())
        if not self.weights_on_inputs:
            out *= scale
        return torch.zeros_like(x).index_add_(0, rows, out)

    def _grouped(self, xs: torch.Tensor) -> bool:
        """One grouped matmul per projection, or the per-expert loop (see _CPU_GROUPED_ROWS_PER_EXPERT)."""
        if not (self.gate_up_proj.groups_in_one_call(xs) and self.down_proj.groups_in_one_call(xs)):
            return False
        return xs.device.type != "cpu" or xs.shape[0] <= _CPU_GROUPED_ROWS_PER_EXPERT * self.num_experts

    def _packed_in_one_call(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        """Both projections of every active expert in one C call each (decode's few rows per expert), or None
        where they are not packed experts' tables or the kernel declines (then the per-expert loop)."""
        gate_up, down = self.gate_up_proj.packed_experts, self.down_proj.packed_experts
        if gate_up is None or down is None or not takes_rows(xs, counts):
            return None
        h = gate_up.matmul(xs, counts)
        return None if h is None else down.matmul(self.glu(h), counts)

    def _per_expert(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """One matmul per active expert over its (contiguous) rows: packed stacks, or no grouped matmul."""
        out = torch.empty_like(xs)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            h = self.glu(self.gate_up_proj.matmul(expert, xs[start:end]))
            out[start:end] = self.down_proj.matmul(expert, h)
            start = end
        return out


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over experts (fp32), then the top-k; renormalize makes each token's k weights sum to 1
    (Mixtral always, Qwen when `norm_topk_prob`)."""
    weights, ids = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SoftmaxRouter(Linear):
    """The gate `weight` [E, hidden] (bias: gpt-oss): softmax, top-k, optionally renormalized (`route`)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool, bias: bool = False) -> None:
        super().__init__(hidden, num_experts, bias=bias)
        if not 0 < top_k <= num_experts:
            raise UnsupportedCheckpointError(
                f"config num_experts_per_tok={top_k} must be between 1 and the expert count {num_experts}")
        self.top_k = top_k
        self.renormalize = renormalize

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(self(x), self.top_k, self.renormalize)


class SparseMoE(nn.Module):
    """Routed experts plus an optional always-on shared expert: scaled by sigmoid(shared_expert_gate(x))
    (Qwen2-MoE) or added as it is (gated_shared=False: ERNIE-4.5, Llama 4).

    router: a module with `route(x) -> (weights, ids)` kept as `gate` (default: SoftmaxRouter);
    experts: an `Experts` of the family's own kind (default: plain gated experts).
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, act: str,
                 renormalize: bool, shared_expert: nn.Module | None = None, gated_shared: bool = True,
                 router: nn.Module | None = None, experts: Experts | None = None) -> None:
        super().__init__()
        self.gate = router or SoftmaxRouter(hidden, num_experts, top_k, renormalize)
        self.experts = experts or Experts(num_experts, hidden, intermediate, act)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(hidden, 1) if shared_expert is not None and gated_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.gate.route(x))
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out


# transformers' fused expert tensors have no `.weight` suffix (`mlp.experts.gate_up_proj`).
FUSED_EXPERT_RENAMES = ((r"\.experts\.(gate_up_proj|down_proj)$", r".experts.\1.weight"),)
# Per-expert and stacked weights, and their biases (gpt-oss's GGUF [E, out] bias stacks).
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.(weight|bias)$")
_STACKED = re.compile(r"\.experts\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")


def expert_param(name: str, shard: int | str | None) -> tuple[str, ExpertShard | int | str | None]:
    """`experts.3.gate_up_proj.weight`, part 1 -> the stacked `experts.gate_up_proj.weight`, shard (3, 1)."""
    match = _PER_EXPERT.search(name)
    if match is None:
        return name, shard
    return f"{name[:match.start()]}.experts.{match[2]}.{match[3]}", (int(match[1]), 0 if shard is None else shard)


def is_expert_stack(name: str) -> bool:
    """llama.cpp's one [E, out, in] tensor per projection of every expert (`experts.gate_proj.weight`),
    or its [E, out] bias (gpt-oss)."""
    return _STACKED.search(name) is not None


def expert_name(stack_name: str, expert: int) -> str:
    """The HF per-expert name of one slice of a stack: `experts.gate_proj.weight` -> `experts.3.gate_proj.weight`."""
    return stack_name.replace(".experts.", f".experts.{expert}.")


def unstack_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Split dense expert stacks into the per-expert tensors HF checkpoints hold (the GGUF reader
    yields packed stacks already split, each expert a view of the file's blocks)."""
    for name, tensor in weights:
        if not is_expert_stack(name) or not isinstance(tensor, torch.Tensor):
            yield name, tensor
            continue
        for expert, part in enumerate(tensor.unbind(0)):
            yield expert_name(name, expert), part


def _gate_then_up(interleaved: torch.Tensor, dim: int) -> torch.Tensor:
    """g0 u0 g1 u1 ... along `dim` -> g0 g1 ... u0 u1 ..."""
    return torch.cat([interleaved.index_select(dim, torch.arange(start, interleaved.shape[dim], 2))
                      for start in (0, 1)], dim=dim)


def in_out_expert_stacks(weights: Iterable[tuple[str, torch.Tensor]],
                         interleaved: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's and Llama 4's transformers stacks are [E, in, out] (`experts.gate_up_proj`,
    `experts.down_proj`): transposed to our [E, out, in]. interleaved: the gate and up columns alternate
    (gpt-oss, its `gate_up_proj_bias` too): gate first, as ours."""
    for name, tensor in weights:
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            tensor = tensor.transpose(1, 2)
        if interleaved and name.endswith((".experts.gate_up_proj", ".experts.gate_up_proj_bias")):
            tensor = _gate_then_up(tensor, dim=1)
        yield name, tensor


class ExpertWeights:
    """CausalLM mixin: per-expert (HF), fused (transformers) and stacked (GGUF) expert tensors all
    load into the stacked `Experts` parameters, through the base class's name mapping."""

    def checkpoint_name_to_param(self, name: str) -> tuple[str, ExpertShard | int | str | None]:
        return expert_param(*super().checkpoint_name_to_param(name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(unstack_experts(weights))
