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
    chunk_size: int | None = None  # keys in the query's own chunk [pos // size * size, pos] (Llama 4's local layers)
    # [heads] per-head logit in every softmax denominator (gpt-oss); the layer's parameter, set at forward
    sinks: torch.Tensor | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class DecodeBatch:
    """The decode tokens as the backends read them: int64 tensors on the batch's device, built once per
    step with the metadata (the group-independent ones once for every group). A decode row with several
    query tokens (a speculative verification: the last token and its drafts) contributes one entry per
    token, each attending its own causal prefix of the paged context, so it stays in the batched call."""

    token_idx: torch.Tensor  # [B] flat index of each decode token in q / out
    rows: torch.Tensor  # [B] 0..B-1: q / out rows once gathered down to the decode tokens
    seq_lens: torch.Tensor  # [B] keys the token sees: its position + 1
    tables: torch.Tensor  # [B, max_blocks] the tokens' sequences' block tables in this group, contiguous


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
    # Rows attended in one batched call: one new token, or a few at the end of their context (drafts).
    decode_rows: list[int] = field(default_factory=list)
    prefill_rows: list[int] = field(default_factory=list)
    # Per-step memo of masks and index tensors, shared by every layer of this group.
    cache: dict = field(default_factory=dict)
    # Per-step memo of tensors that do not depend on the group, shared by every group's metadata.
    shared: dict = field(default_factory=dict)
    backend: AttentionBackend | None = None  # what built this metadata and runs the layers on it
    # Per sequence, the position ranges [start, end) inside which attention is bidirectional (Gemma 3's
    # image spans; the scheduler puts a span in one chunk); None: causal everywhere.
    bidirectional_spans: list[list[tuple[int, int]]] | None = None
    decode: DecodeBatch | None = field(init=False, default=None)  # None when no row decodes
    decode_seq_lens: list[int] = field(init=False, default_factory=list)  # host copy of decode.seq_lens

    def __post_init__(self) -> None:
        if not self.decode_rows:
            return
        device = self.block_tables.device
        if "decode" not in self.shared:
            tokens, lens, rows = [], [], []
            for r in self.decode_rows:
                start, end = self.query_start_loc[r], self.query_start_loc[r + 1]
                tokens += range(start, end)
                lens += range(self.seq_lens[r] - (end - start) + 1, self.seq_lens[r] + 1)
                rows += [r] * (end - start)
            self.shared["decode"] = (
                torch.tensor(tokens, dtype=torch.int64, device=device),
                torch.arange(len(tokens), dtype=torch.int64, device=device),
                torch.tensor(lens, dtype=torch.int64, device=device), lens, rows)
        token_idx, index, seq_lens, lens, rows = self.shared["decode"]
        self.decode_seq_lens = lens
        tables = self.block_tables.to(torch.int64)
        if rows != list(range(self.num_seqs)):  # else one token per row and every row decodes: as it is
            tables = tables.index_select(0, torch.tensor(rows, dtype=torch.int64, device=device))
        self.decode = DecodeBatch(token_idx, index, seq_lens, tables=tables.contiguous())

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, row: int) -> int:
        return self.query_start_loc[row + 1] - self.query_start_loc[row]
