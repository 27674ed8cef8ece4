"""Attention metadata built once per step, and the per-layer attention spec."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


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


@dataclass
class AttentionMetadata:
    """The flat batch's layout: which tokens belong to which sequence and where their K/V live."""

    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with 0
    query_start_loc: list[int]  # [S + 1] offsets of each sequence's new tokens in the flat batch
    seq_lens: list[int]  # [S] context length after this step (cached + new)
    block_size: int
    # Rows with exactly one new token are attended in one batched call.
    decode_rows: list[int] = field(default_factory=list)
    prefill_rows: list[int] = field(default_factory=list)
    # Per-step memo of masks and index tensors, shared by every layer of this step.
    cache: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, row: int) -> int:
        return self.query_start_loc[row + 1] - self.query_start_loc[row]
