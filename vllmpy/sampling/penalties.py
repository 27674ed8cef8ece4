"""Repetition, frequency and presence penalties (vLLM semantics), as batched tensor ops."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllmpy.sampling.metadata import RowState


@dataclass
class Penalties:
    """Per-row penalty values and token statistics; a part is None when no row in the batch uses it."""

    repetition: torch.Tensor | None  # [B, 1]; rows without it hold 1.0
    seen: torch.Tensor | None  # [B, V] bool: token appears in prompt or output (repetition rows only)
    frequency: torch.Tensor | None  # [B, 1]
    presence: torch.Tensor | None  # [B, 1]
    output_counts: torch.Tensor | None  # [B, V] float32 counts of output tokens (freq/presence rows only)


def build_penalties(rows: list[RowState], vocab_size: int, device: torch.device) -> Penalties | None:
    rep = [r.params.repetition_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    rep_rows = [i for i, v in enumerate(rep) if v != 1.0]
    count_rows = [i for i in range(len(rows)) if freq[i] != 0.0 or pres[i] != 0.0]
    if not rep_rows and not count_rows:
        return None
    seen = None
    if rep_rows:
        seen = _token_counts(
            [rows[i].prompt_token_ids + rows[i].output_token_ids for i in rep_rows],
            rep_rows, len(rows), vocab_size, device,
        ) > 0
    counts = None
    if count_rows:
        counts = _token_counts([rows[i].output_token_ids for i in count_rows], count_rows, len(rows), vocab_size, device)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    return Penalties(
        repetition=column(rep) if rep_rows else None,
        seen=seen,
        frequency=column(freq) if count_rows else None,
        presence=column(pres) if count_rows else None,
        output_counts=counts,
    )


def _token_counts(
    token_lists: list[list[int]], row_ids: list[int], num_rows: int, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[num_rows, V] counts; ids outside the vocabulary land in a spare column that is dropped."""
    flat_rows = [row for row, ids in zip(row_ids, token_lists) for _ in ids]
    flat_ids = torch.tensor([t for ids in token_lists for t in ids], dtype=torch.int64, device=device)
    flat_ids = torch.where((flat_ids >= 0) & (flat_ids < vocab_size), flat_ids, vocab_size)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    counts.index_put_(
        (torch.tensor(flat_rows, dtype=torch.int64, device=device), flat_ids),
        torch.ones(flat_ids.shape[0], dtype=torch.float32, device=device),
        accumulate=True,
    )
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """Repetition divides positive / multiplies negative logits of seen tokens; then
    logits -= frequency * count + presence * (count > 0) over output tokens."""
    if p.repetition is not None and p.seen is not None:
        scale = torch.where(p.seen, p.repetition, 1.0)
        logits = torch.where(logits > 0, logits / scale, logits * scale)
    if p.output_counts is not None and p.frequency is not None and p.presence is not None:
        logits = logits - p.frequency * p.output_counts - p.presence * (p.output_counts > 0)
    return logits
