"""Attention metadata built once per step (one per KV cache group), and the per-layer attention spec."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllmpy.attention.backends import AttentionBackend


@dataclass(frozen=True)
class AttentionSpec:
    """What differs between attention layers: scaling, window, soft-capping, causality."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # keys in (q_pos - window, q_pos] are visible
    logit_soft_cap: float | None = None
    causal: bool = True  # False: an encoder (BERT), every token sees the whole sequence


@dataclass(frozen=True)
class DecodeBatch:
    """The decode rows (one new token each) as the backends read them: int64 tensors on the batch's
    device, built once per step with the metadata (the group-independent ones once for every group)."""

    token_idx: torch.Tensor  # [B] flat index of each decode row's token in q / out
    rows: torch.Tensor  # [B] 0..B-1: q / out rows once gathered down to the decode rows
    seq_lens: torch.Tensor  # [B] context length after this step
    tables: torch.Tensor  # [B, max_blocks] the rows' block tables in this group, contiguous


@dataclass
class AttentionMetadata:
    """The flat batch's layout: which tokens belong to which sequence and where their K/V live.

    One per KV cache group: slot_mapping, block_tables and decode.tables are the group's, the rest is the
    same batch. The tensors are what backends read; the int lists are the host-side layout that drives
    per-sequence loops (the prefill rows), as vLLM keeps its `*_cpu` copies.
    """

    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with 0 (as are blocks a window has left)
    query_start_loc: list[int]  # [S + 1] offsets of each sequence's new tokens in the flat batch
    seq_lens: list[int]  # [S] context length after this step (cached + new)
    block_size: int
    # Rows with exactly one new token are attended in one batched call.
    decode_rows: list[int] = field(default_factory=list)
    prefill_rows: list[int] = field(default_factory=list)
    # Per-step memo of masks and index tensors, shared by every layer of this group.
    cache: dict = field(default_factory=dict)
    # Per-step memo of tensors that do not depend on the group, shared by every group's metadata.
    shared: dict = field(default_factory=dict)
    backend: AttentionBackend | None = None  # what built this metadata and runs the layers on it
    decode: DecodeBatch | None = field(init=False, default=None)  # None when no row decodes

    def __post_init__(self) -> None:
        if not self.decode_rows:
            return
        device, rows = self.block_tables.device, self.decode_rows
        if "decode" not in self.shared:
            self.shared["decode"] = (
                torch.tensor([self.query_start_loc[r] for r in rows], dtype=torch.int64, device=device),
                torch.arange(len(rows), dtype=torch.int64, device=device),
                torch.tensor([self.seq_lens[r] for r in rows], dtype=torch.int64, device=device))
        tables = self.block_tables.to(torch.int64)
        if len(rows) < self.num_seqs:  # else every row decodes: the table as it is
            tables = tables.index_select(0, torch.tensor(rows, dtype=torch.int64, device=device))
        self.decode = DecodeBatch(*self.shared["decode"], tables=tables.contiguous())

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, row: int) -> int:
        return self.query_start_loc[row + 1] - self.query_start_loc[row]
