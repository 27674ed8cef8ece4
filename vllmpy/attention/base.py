"""Attention metadata built once per step (one per KV cache group), the step layout it is built from,
and the per-layer attention spec."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

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

    @property
    def decode_view(self) -> DecodeView:
        """What a decode token's torch path gathers and masks by (build_metadata indexes each view once)."""
        return self.sliding_window, self.chunk_size


# A layer's (sliding window, attention chunk): the keys a decode token can see beyond causality.
DecodeView = tuple[int | None, int | None]


@dataclass(frozen=True)
class StepLayout:
    """The step's flat batch as the runner scheduled it, in host ints, the same for every KV cache group:
    what a backend's build_metadata turns into the tensors its layers read, once per step."""

    query_start_loc: Sequence[int]  # [S + 1] offsets of each sequence's new tokens in the flat batch
    seq_lens: Sequence[int]  # [S] context length after this step (cached + new)
    num_draft_tokens: Sequence[int]  # [S] speculative drafts at the end of each sequence's new tokens
    block_size: int
    # Per sequence, the position ranges [start, end) inside which attention is bidirectional (Gemma 3's
    # image spans; the scheduler puts a span in one chunk); None: causal everywhere.
    bidirectional_spans: Sequence[Sequence[tuple[int, int]]] | None = None


@dataclass(frozen=True)
class GroupInputs:
    """One KV cache group's part of the step: where its new K/V go and its requests' block tables."""

    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with 0 (as are blocks a window has left)
    views: frozenset[DecodeView] = frozenset()  # its layers' windows / chunks (a backend may index them)


@dataclass(frozen=True)
class DecodeBatch:
    """The decode tokens as the backends read them: int64 tensors on the batch's device. A decode row with
    several query tokens (a speculative verification: the last token and its drafts) contributes one entry
    per token, each attending its own causal prefix of the paged context, so it stays in the batched call."""

    token_idx: torch.Tensor  # [B] flat index of each decode token in q / out
    rows: torch.Tensor  # [B] 0..B-1: q / out rows once gathered down to the decode tokens
    seq_lens: torch.Tensor  # [B] keys the token sees: its position + 1
    tables: torch.Tensor  # [B, max_blocks] the tokens' sequences' block tables in this group, contiguous


class PrefillSeq(NamedTuple):
    """One prefill sequence's place in the flat batch, in host ints: what the per-sequence loop slices by."""

    row: int  # its index in the batch (its block table row)
    start: int  # its first new token in the flat batch
    end: int  # one past its last
    seq_len: int  # its context after this step
    spans: Sequence[tuple[int, int]] = ()  # its bidirectional position ranges (StepLayout)


@dataclass(frozen=True)
class PrefillBatch:
    """The sequences attended one at a time: [P] int64 tensors for a kernel that takes them whole, and
    `seqs`, the same layout in host ints for the torch loop (a device tensor read per row would sync)."""

    rows: torch.Tensor  # [P] their batch indices
    query_start: torch.Tensor  # [P] first new token of each in the flat batch
    query_lens: torch.Tensor  # [P] new tokens
    context_lens: torch.Tensor  # [P] tokens cached before this step
    seqs: tuple[PrefillSeq, ...]


@dataclass(frozen=True)
class AttentionMetadata:
    """What the layers of one KV cache group read this step, built once by the backend (build_metadata).

    slot_mapping, block_tables, decode.tables and decode_index are the group's, the rest is the same batch
    (the very tensors, shared by every group). Layers never see the runner's lists: host ints that a loop
    needs are in `prefill.seqs`, built with the tensors.
    """

    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with 0 (as are blocks a window has left)
    query_start_loc: torch.Tensor  # [S + 1] int64 offsets of each sequence's new tokens in the flat batch
    seq_lens: torch.Tensor  # [S] int64 context length after this step (cached + new)
    block_size: int
    # Sequences attended in one batched call (one new token over a context, or a few at its end: drafts);
    # None when no row decodes. The rest are prefill rows, attended sequence by sequence.
    decode: DecodeBatch | None
    prefill: PrefillBatch | None
    backend: AttentionBackend
    # The torch path's decode gathers, per DecodeView of the group's layers (torch backend; built with it).
    decode_index: Mapping[DecodeView, DecodeIndex] = field(default_factory=dict)


@dataclass(frozen=True)
class DecodeIndex:
    """The blocks a decode token's torch path reads and which of their positions it sees, for one view."""

    blocks: torch.Tensor  # [B, width] block ids, from the first block the view needs
    visible: torch.Tensor  # [B, width * block_size] the positions the token attends
