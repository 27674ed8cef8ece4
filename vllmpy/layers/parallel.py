"""Tensor-parallel sharding of a model built on the meta device (Megatron's layout, as vLLM's).

`shard_model` walks the full-size model before it is materialized and shrinks each parameter to this
rank's piece; `load_weights` then narrows each checkpoint tensor the same way (a module's `tp_split`),
so a rank only ever holds its rows or columns:
- column-parallel (output rows split): q/k/v heads and gate/up, per fused part. KV heads split when
  there are at least as many as ranks, else replicated: rank r keeps KV head r * kv_heads // ranks (vLLM).
- row-parallel (input columns split): o_proj, down_proj / fc2, experts' down; one all-reduce of the
  output each (a forward hook), the bias added on rank 0 only.
- vocab-parallel: the embedding keeps rows [r * V/N, (r+1) * V/N) (padded to a multiple of the ranks),
  a lookup zeroes the ids other ranks own and all-reduces; the LM head keeps the same rows and its logits
  are gathered on the driver (None on the other ranks).
- MoE: every expert's intermediate dimension split (gate/up column, down row), one all-reduce per
  layer; routers replicated.
Packed GGML weights are narrowed in their blocks: rows as they are, columns at block boundaries (else
that one weight is decoded, logged). Anything else with parameters is refused by name at startup.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from vllmpy.attention.layer import PagedAttention
from vllmpy.distributed.parallel_state import TPGroup
from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.kernels import block_layout
from vllmpy.layers.embedding import VocabEmbedding
from vllmpy.layers.linear import Linear, MergedLinear
from vllmpy.layers.moe import ExpertLinear, Experts, SparseMoE
from vllmpy.layers.norm import LayerNorm, RMSNorm
from vllmpy.layers.quantized import PackedTensor

logger = logging.getLogger("vllmpy")
Weight = torch.Tensor | PackedTensor  # a checkpoint tensor as the loader hands it over


@dataclass(frozen=True)
class Part:
    """One fused part of a column-parallel weight: its full row count and this rank's slice of it."""

    full: int
    start: int
    size: int


def _narrow_rows(t: Weight, dim: int, start: int, size: int) -> Weight:
    if isinstance(t, PackedTensor):  # rows of blocks: a view, nothing decoded
        return PackedTensor(t.data[start:start + size], t.ggml_type, (size, t.shape[1]), t.input_perm)
    return t.narrow(dim, start, size)


def _narrow_cols(t: Weight, start: int, size: int, name: str) -> Weight:
    """Columns [start, start + size): whole blocks of a packed weight when they align, else decoded."""
    if not isinstance(t, PackedTensor):
        return t.narrow(-1, start, size)
    elems, nbytes = block_layout(t.ggml_type)
    if t.input_perm is None and start % elems == 0 and size % elems == 0:
        data = t.data[:, start // elems * nbytes:(start + size) // elems * nbytes].contiguous()  # kernels read dense rows
        return PackedTensor(data, t.ggml_type, (t.shape[0], size))
    logger.info("tensor parallel: %s's %d-column shard does not fall on %d-value blocks; decoded", name, size, elems)
    return t.dequantize().narrow(-1, start, size)


class ColumnSplit:
    """Output rows split per fused part; `parts` keyed by the module's shard ids (their part for experts)."""

    def __init__(self, parts: dict[int | str | None, Part]) -> None:
        self.parts = parts

    def __call__(self, param: str, t: Weight, shard: object) -> Weight:
        dim = -2 if param == "weight" else -1
        key = shard[1] if isinstance(shard, tuple) else shard
        if key in self.parts:
            part = self.parts[key]
            return _narrow_rows(t, dim, part.start, part.size)
        pieces, offset = [], 0  # the whole fused tensor (or a single-part layer's)
        for part in self.parts.values():
            pieces.append(_narrow_rows(t, dim, offset + part.start, part.size))
            offset += part.full
        if isinstance(t, PackedTensor):
            return functools.reduce(PackedTensor.concat, pieces)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


class RowSplit:
    """Input columns split; the bias stays whole on rank 0 and is zero elsewhere (added once by the sum)."""

    def __init__(self, start: int, size: int, rank: int, name: str) -> None:
        self.start, self.size, self.rank, self.name = start, size, rank, name

    def __call__(self, param: str, t: Weight, shard: object) -> Weight:
        if param == "weight":
            return _narrow_cols(t, self.start, self.size, self.name)
        return t if self.rank == 0 else torch.zeros_like(t)


class VocabSplit:
    """Rows [start, start + size) of a vocab table, zero-padded to `local` rows on the last rank."""

    def __init__(self, start: int, size: int, local: int) -> None:
        self.start, self.size, self.local = start, size, local

    def __call__(self, param: str, t: Weight, shard: object) -> Weight:
        rows = _narrow_rows(t, 0, self.start, self.size)
        if self.size == self.local:
            return rows
        dense = rows.dequantize() if isinstance(rows, PackedTensor) else rows
        return torch.cat([dense, dense.new_zeros(self.local - self.size, *dense.shape[1:])])


class VocabParallelEmbedding(VocabEmbedding):
    """A VocabEmbedding holding rows [vocab_start, vocab_start + rows) of the table: ids outside that range
    look up zeros, and the sum over ranks is the full lookup."""

    group: TPGroup
    vocab_start: int

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = super().forward(local.masked_fill(outside, 0))
        return self.group.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


def _resize(module: nn.Module, name: str, shape: tuple[int, ...]) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(torch.empty(shape, dtype=old.dtype, device=old.device), requires_grad=False))


def _split_heads(group: TPGroup, heads: int, kv_heads: int, where: str) -> tuple[int, int, int, int]:
    """(q heads here, first q head, kv heads here, first kv head)."""
    n, r = group.world_size, group.rank
    if heads % n:
        raise UnsupportedCheckpointError(f"{where}: {heads} attention heads do not split over "
                                         f"--tensor-parallel-size {n}; choose a size that divides {heads}")
    if kv_heads >= n and kv_heads % n == 0:
        return heads // n, r * heads // n, kv_heads // n, r * kv_heads // n
    if kv_heads < n and n % kv_heads == 0:  # replicated: each KV head serves n / kv_heads ranks
        return heads // n, r * heads // n, 1, r * kv_heads // n
    raise UnsupportedCheckpointError(f"{where}: {kv_heads} KV heads neither split over nor replicate across "
                                     f"--tensor-parallel-size {n}; choose a divisor or multiple of {kv_heads}")


def _column(module: Linear | MergedLinear, parts: dict[int | str | None, Part]) -> None:
    out = sum(part.size for part in parts.values())
    _resize(module, "weight", (out, module.weight.shape[1]))
    if module.bias is not None:
        _resize(module, "bias", (out,))
    module.out_features = out
    if isinstance(module, MergedLinear):
        if set(parts) != set(module.shard_offsets):
            raise UnsupportedCheckpointError(f"{type(module).__name__} parts {list(module.shard_offsets)} are not "
                                             f"the ones tensor parallel splits ({list(parts)})")
        module.shard_offsets = _local_offsets(parts)
    module.tp_split = ColumnSplit(parts)


def _local_offsets(parts: dict[object, Part]) -> dict[object, tuple[int, int]]:
    """Each part's (offset, size) rows in this rank's fused weight."""
    offsets, offset = {}, 0
    for key, part in parts.items():
        offsets[key] = (offset, part.size)
        offset += part.size
    return offsets


def _even(full: int, group: TPGroup, where: str) -> Part:
    n = group.world_size
    if full % n:
        raise UnsupportedCheckpointError(f"{where}: size {full} does not split over --tensor-parallel-size {n}")
    return Part(full, group.rank * full // n, full // n)


def _row(module: Linear, group: TPGroup, name: str) -> None:
    full = module.weight.shape[-1]
    part = _even(full, group, name)
    _resize(module, "weight", (*module.weight.shape[:-1], part.size))
    module.in_features = part.size
    module.tp_split = RowSplit(part.start, part.size, group.rank, name)
    module.register_forward_hook(lambda _m, _args, out: group.all_reduce(out))


def _attention(attn: nn.Module, group: TPGroup, name: str) -> None:
    from vllmpy.models.llama import Attention

    if type(attn).forward is not Attention.forward:
        raise UnsupportedCheckpointError(f"{name} ({type(attn).__name__}) has its own attention forward, "
                                         f"which tensor parallel does not shard yet")
    if attn.q_norm is not None and (attn.qk_norm_flat or any(
            p.shape != (attn.head_dim,) for p in [*attn.q_norm.parameters(), *attn.k_norm.parameters()])):
        raise UnsupportedCheckpointError(f"{name}: q/k norms over several heads are not sharded by tensor "
                                         f"parallel yet (only one [head_dim] weight shared by all heads)")
    if attn.attn.sinks is not None:
        raise UnsupportedCheckpointError(f"{name}: attention sinks are not sharded by tensor parallel yet")
    d = attn.head_dim
    heads, first, kv_heads, first_kv = _split_heads(group, attn.num_heads, attn.num_kv_heads, name)
    _column(attn.qkv_proj, {"q": Part(attn.num_heads * d, first * d, heads * d),
                            "k": Part(attn.num_kv_heads * d, first_kv * d, kv_heads * d),
                            "v": Part(attn.num_kv_heads * d, first_kv * d, kv_heads * d)})
    _row(attn.o_proj, group, f"{name}.o_proj")
    attn.num_heads, attn.num_kv_heads = heads, kv_heads
    attn.spec = attn.attn.spec = replace(attn.spec, num_heads=heads, num_kv_heads=kv_heads)


def _gate_up(module: MergedLinear | ExpertLinear, group: TPGroup, name: str) -> None:
    sizes = {part: size for (_, part), (_, size) in module.shard_offsets.items()} if isinstance(
        module, ExpertLinear) else {shard: size for shard, (_, size) in module.shard_offsets.items()}
    parts = {part: _even(size, group, name) for part, size in sizes.items()}
    if isinstance(module, MergedLinear):
        _column(module, parts)
        return
    out = sum(part.size for part in parts.values())
    _resize(module, "weight", (module.weight.shape[0], out, module.weight.shape[2]))
    if module.bias is not None:
        _resize(module, "bias", (module.bias.shape[0], out))
    offsets = _local_offsets(parts)
    module.shard_offsets = {key: offsets[key[1]] for key in module.shard_offsets}
    module.tp_split = ColumnSplit(parts)


def _experts(experts: Experts, group: TPGroup, name: str) -> None:
    _gate_up(experts.gate_up_proj, group, f"{name}.gate_up_proj")
    down = experts.down_proj
    part = _even(down.weight.shape[2], group, f"{name}.down_proj")
    _resize(down, "weight", (down.weight.shape[0], down.weight.shape[1], part.size))
    down.tp_split = RowSplit(part.start, part.size, group.rank, f"{name}.down_proj")
    experts.register_forward_hook(lambda _m, _args, out: group.all_reduce(out))


def _vocab(module: VocabEmbedding | Linear, group: TPGroup, vocab: int) -> VocabSplit:
    local = -(-vocab // group.world_size)
    start = group.rank * local
    size = max(0, min(vocab, start + local) - start)
    _resize(module, "weight", (local, module.weight.shape[1]))
    if getattr(module, "bias", None) is not None:  # Phi's head bias: the same rows
        _resize(module, "bias", (local,))
    module.tp_split = VocabSplit(start, size, local)
    return module.tp_split


def _gathered_logits(compute: Callable[[torch.Tensor], torch.Tensor], group: TPGroup, vocab: int,
                     hidden: torch.Tensor) -> torch.Tensor | None:
    """The driver's [rows, vocab] logits from every rank's vocab slice; None elsewhere (nothing to sample)."""
    logits = group.gather_to_driver(compute(hidden))
    return None if logits is None else logits[..., :vocab]


# Modules whose parameters every rank keeps whole: norms over the (replicated) hidden state.
_REPLICATED = (RMSNorm, LayerNorm, nn.LayerNorm, nn.Embedding)


def shard_model(model: nn.Module, group: TPGroup) -> None:
    """Shrink the meta-device `model` to this rank's shard, or refuse it naming the module that has no
    tensor-parallel layout yet."""
    from vllmpy.models.llama import MLP, Attention, GatedMLP

    arch = type(model).__name__
    if any(isinstance(m, (nn.Conv1d, nn.Conv2d)) for m in model.modules()) or hasattr(model, "encode_images"):
        raise UnsupportedCheckpointError(f"{arch}: tensor parallel does not shard vision or convolution layers yet")
    vocab = model.config["vocab_size"]
    done: set[nn.Module] = set()

    def take(module: nn.Module) -> None:
        done.update(module.modules())

    for name, module in model.named_modules():
        if module in done:
            continue
        where = f"{arch}.{name}"
        if isinstance(module, Attention):
            _attention(module, group, where)
            take(module)
        elif isinstance(module, GatedMLP):
            _gate_up(module.gate_up_proj, group, f"{where}.gate_up_proj")
            _row(module.down_proj, group, f"{where}.down_proj")
            take(module)
        elif type(module) is MLP:
            _column(module.fc1, {None: _even(module.fc1.weight.shape[0], group, f"{where}.fc1")})
            _row(module.fc2, group, f"{where}.fc2")
            take(module)
        elif isinstance(module, SparseMoE):
            take(module.gate)  # routers read the whole hidden state, replicated
            if module.shared_expert_gate is not None:
                take(module.shared_expert_gate)
        elif type(module) is Experts:
            _experts(module, group, where)
            take(module)
        elif type(module) is VocabEmbedding and name.endswith("embed_tokens"):
            _vocab(module, group, vocab)
            module.__class__ = VocabParallelEmbedding
            module.group, module.vocab_start = group, module.tp_split.start
            module.num_embeddings = module.weight.shape[0]
            take(module)
        elif name == "lm_head" and type(module) is Linear:
            _vocab(module, group, vocab)
            module.out_features = module.weight.shape[0]
            model.compute_logits = functools.partial(_gathered_logits, model.compute_logits, group, vocab)
            take(module)
        elif isinstance(module, _REPLICATED):
            take(module)
        elif isinstance(module, PagedAttention) or next(module.parameters(recurse=False), None) is not None:
            raise UnsupportedCheckpointError(
                f"{arch}: {name} ({type(module).__name__}) has no tensor-parallel layout yet; "
                f"run it with --tensor-parallel-size 1")
