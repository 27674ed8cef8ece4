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


class TokenCounts:
    """One row's token statistics, kept across steps: each step folds in only the output tokens appended
    since the last, so its cost does not grow with the context. Ids outside the vocabulary are ignored."""

    def __init__(self, prompt_token_ids: list[int], vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # in prompt or output
        self.output = torch.zeros(vocab_size, dtype=torch.float32, device=device)  # counts in output
        self.seen[self._valid(prompt_token_ids)] = True
        self.num_counted = 0

    def update(self, output_token_ids: list[int]) -> None:
        new = output_token_ids[self.num_counted:]
        self.num_counted = len(output_token_ids)
        if new:
            ids = self._valid(new)
            self.seen[ids] = True
            self.output.index_put_((ids,), torch.ones(ids.shape[0], device=ids.device), accumulate=True)

    def fork(self) -> TokenCounts:
        """A copy to fold a speculative draft prefix into, leaving these counts as they are."""
        copy = object.__new__(TokenCounts)
        copy.vocab_size, copy.num_counted = self.vocab_size, self.num_counted
        copy.seen, copy.output = self.seen.clone(), self.output.clone()
        return copy

    def _valid(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([t for t in ids if 0 <= t < self.vocab_size], dtype=torch.int64,
                            device=self.seen.device)


def build_penalties(rows: list[RowState], vocab_size: int, device: torch.device) -> Penalties | None:
    """Per-row statistics come from each row's TokenCounts (made on its first penalized step)."""
    rep = [r.params.repetition_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    rep_rows = [i for i, v in enumerate(rep) if v != 1.0]
    count_rows = [i for i in range(len(rows)) if freq[i] != 0.0 or pres[i] != 0.0]
    if not rep_rows and not count_rows:
        return None
    for i in sorted(set(rep_rows) | set(count_rows)):
        row = rows[i]
        if row.counts is None:
            row.counts = TokenCounts(row.prompt_token_ids, vocab_size, device)
        row.counts.update(row.output_token_ids)
    seen = _stack(rows, rep_rows, "seen", torch.bool, vocab_size, device) if rep_rows else None
    counts = _stack(rows, count_rows, "output", torch.float32, vocab_size, device) if count_rows else None

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    return Penalties(
        repetition=column(rep) if rep_rows else None,
        seen=seen,
        frequency=column(freq) if count_rows else None,
        presence=column(pres) if count_rows else None,
        output_counts=counts,
    )


def _stack(rows: list[RowState], picked: list[int], name: str, dtype: torch.dtype, vocab_size: int,
           device: torch.device) -> torch.Tensor:
    """[len(rows), V]: the picked rows' statistic `name`, zeros elsewhere."""
    if len(picked) == len(rows):
        return torch.stack([getattr(rows[i].counts, name) for i in picked])
    out = torch.zeros(len(rows), vocab_size, dtype=dtype, device=device)
    out[picked] = torch.stack([getattr(rows[i].counts, name) for i in picked])
    return out


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """Repetition divides positive / multiplies negative logits of seen tokens; then
    logits -= frequency * count + presence * (count > 0) over output tokens."""
    if p.repetition is not None and p.seen is not None:
        scale = torch.where(p.seen, p.repetition, 1.0)
        logits = torch.where(logits > 0, logits / scale, logits * scale)
    if p.output_counts is not None and p.frequency is not None and p.presence is not None:
        logits = logits - p.frequency * p.output_counts - p.presence * (p.output_counts > 0)
    return logits
