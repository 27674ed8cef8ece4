"""The step's batch tensors, built from the runner's StepLayout once per step and shared by every KV
cache group's AttentionMetadata (the backends' build_metadata; vLLM's CommonAttentionMetadata).

A sequence decodes (joins the batched decode call) when it extends a cached context: one new token, or
a speculative verification's last token and drafts. Every other sequence is a prefill row, attended on
its own, so an encoder's whole prompts (even one token long) are all prefill rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllmpy.attention.base import DecodeBatch, GroupInputs, PrefillBatch, PrefillSeq, StepLayout


@dataclass(frozen=True)
class BatchTensors:
    """The group-independent tensors of a step; `decode_for` adds a group's decode tables."""

    query_start_loc: torch.Tensor  # [S + 1] int64
    seq_lens: torch.Tensor  # [S] int64
    prefill: PrefillBatch | None
    # The decode tokens' flat indices, 0..B-1 and seq lens; their rows' block-table rows (None: every row
    # decodes one token, so the group's table is already theirs).
    decode_tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    decode_table_rows: torch.Tensor | None

    @classmethod
    def build(cls, layout: StepLayout, device: torch.device) -> BatchTensors:
        starts, lens = layout.query_start_loc, layout.seq_lens
        num_seqs = len(lens)
        common = torch.tensor([*starts, *lens], dtype=torch.int64, device=device)
        query_start_loc, seq_lens = common[:num_seqs + 1], common[num_seqs + 1:]
        if starts[-1] == num_seqs and all(n > 1 for n in lens):  # the usual decode step: one token per row
            index = torch.arange(num_seqs, dtype=torch.int64, device=device)
            return cls(query_start_loc, seq_lens, None, (index, index, seq_lens), None)
        tokens, token_lens, token_rows, prefill = [], [], [], []
        for row in range(num_seqs):
            start, end, seq_len = starts[row], starts[row + 1], lens[row]
            if layout.num_draft_tokens[row] or (end - start == 1 and seq_len > 1):
                tokens += range(start, end)
                token_lens += range(seq_len - (end - start) + 1, seq_len + 1)
                token_rows += [row] * (end - start)
            else:
                spans = layout.bidirectional_spans[row] if layout.bidirectional_spans else ()
                prefill.append(PrefillSeq(row, start, end, seq_len, spans))
        decode_tokens = decode_table_rows = None
        if tokens:
            packed = torch.tensor([tokens, token_lens], dtype=torch.int64, device=device)
            decode_tokens = (packed[0], torch.arange(len(tokens), dtype=torch.int64, device=device), packed[1])
            if token_rows != list(range(num_seqs)):
                decode_table_rows = torch.tensor(token_rows, dtype=torch.int64, device=device)
        return cls(query_start_loc, seq_lens, _prefill_batch(prefill, device), decode_tokens, decode_table_rows)

    def decode_for(self, group: GroupInputs) -> DecodeBatch | None:
        """The decode tokens over this group's block tables (one table row per token)."""
        if self.decode_tokens is None:
            return None
        tables = group.block_tables
        if self.decode_table_rows is not None:
            tables = tables.index_select(0, self.decode_table_rows)
        return DecodeBatch(*self.decode_tokens, tables=tables.contiguous())


def _prefill_batch(seqs: list[PrefillSeq], device: torch.device) -> PrefillBatch | None:
    if not seqs:
        return None
    columns = [[s.row for s in seqs], [s.start for s in seqs], [s.end - s.start for s in seqs],
               [s.seq_len - s.end + s.start for s in seqs]]
    rows, starts, query_lens, context_lens = torch.tensor(columns, dtype=torch.int64, device=device)
    return PrefillBatch(rows, starts, query_lens, context_lens, tuple(seqs))
