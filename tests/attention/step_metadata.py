"""One KV cache group's AttentionMetadata for a test batch, built the way the runner builds it."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from vllmpy.attention.backends import AttentionBackend
from vllmpy.attention.base import AttentionMetadata, DecodeView, GroupInputs, StepLayout


def one_group(backend: AttentionBackend, rows: Sequence[tuple[int, int]], block_tables: torch.Tensor,
              slot_mapping: torch.Tensor, block_size: int, num_draft_tokens: Sequence[int] | None = None,
              views: Sequence[DecodeView] = ()) -> AttentionMetadata:
    """rows: (cached context, new tokens) per sequence; views: the (window, chunk) of the layers run on it."""
    starts = [0]
    for _, new in rows:
        starts.append(starts[-1] + new)
    layout = StepLayout(starts, [cached + new for cached, new in rows], num_draft_tokens or [0] * len(rows),
                        block_size)
    return backend.build_metadata(layout, [GroupInputs(slot_mapping, block_tables, frozenset(views))])[0]
