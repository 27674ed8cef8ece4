"""Persistent block tables: one int64 row per running request and KV cache group, kept across steps.

A request's table only grows while it runs (a sliding window turns entries it left into placeholders,
but those positions are never read again; speculation's trimmed tail is announced by the scheduler and
rewritten), so the scheduler sends only the entries added since the request's last chunk (its whole
table when it starts or resumes) and each step appends them; the step's [rows, width] table is one
index_select and its slot mapping one gather, instead of padding and converting every request's whole
table from Python lists each step (vLLM's BlockTable does the same).
"""
from __future__ import annotations

import torch


class BlockTables:
    def __init__(self, num_groups: int, device: torch.device, capacity: int = 16, width: int = 16) -> None:
        self.device = device
        self.tables = [torch.zeros(capacity, width, dtype=torch.int64, device=device) for _ in range(num_groups)]
        self.lengths: dict[str, list[int]] = {}  # req_id -> entries its row holds, per group
        self.rows: dict[str, int] = {}  # req_id -> its row
        self._free = list(range(capacity - 1, -1, -1))

    def remove(self, req_id: str) -> None:
        row = self.rows.pop(req_id, None)
        if row is not None:
            for group, length in enumerate(self.lengths.pop(req_id)):
                self.tables[group][row, :length] = 0  # the row's next owner pads with 0 as well
            self._free.append(row)

    def append(self, req_id: str, new_block_ids: tuple[list[int], ...]) -> None:
        """Append each group's new entries to the request's row (a request not held yet: its first row)."""
        if req_id not in self.rows:
            if not self._free:
                self._grow_rows()
            self.rows[req_id] = self._free.pop()
            self.lengths[req_id] = [0] * len(self.tables)
        row, lengths = self.rows[req_id], self.lengths[req_id]
        for group, ids in enumerate(new_block_ids):
            if not ids:
                continue
            known, end = lengths[group], lengths[group] + len(ids)
            if end > self.tables[group].shape[1]:
                self._grow_width(group, end)
            self.tables[group][row, known:end] = torch.tensor(ids, dtype=torch.int64)
            lengths[group] = end

    def truncate(self, req_id: str, num_blocks: int) -> None:
        """The scheduler gave back the request's blocks past `num_blocks` (rejected drafts' blocks): the
        entries after it are rewritten when the table grows again."""
        lengths = self.lengths.get(req_id)
        if lengths is not None:
            self.lengths[req_id] = [min(length, num_blocks) for length in lengths]

    def row_index(self, req_ids: list[str]) -> torch.Tensor:
        """The requests' rows, for gather and slot_mapping."""
        return torch.tensor([self.rows[r] for r in req_ids], dtype=torch.int64, device=self.device)

    def gather(self, req_ids: list[str], rows: torch.Tensor, group: int) -> torch.Tensor:
        """[len(req_ids), widest of them] int64, padded with 0 (never read: past each row's context)."""
        width = max(self.lengths[r][group] for r in req_ids)
        return self.tables[group][:, :width].index_select(0, rows)

    def slot_mapping(self, token_rows: torch.Tensor, positions: torch.Tensor, block_size: int,
                     group: int) -> torch.Tensor:
        """[T] flat cache slot (block * block_size + offset) of each token, from its row (token_rows: the
        row of its request) and position."""
        blocks = self.tables[group][token_rows, torch.div(positions, block_size, rounding_mode="floor")]
        return blocks * block_size + positions % block_size

    def _grow_rows(self) -> None:
        capacity = self.tables[0].shape[0]
        self.tables = [torch.cat([t, torch.zeros_like(t)]) for t in self.tables]
        self._free = list(range(2 * capacity - 1, capacity - 1, -1))

    def _grow_width(self, group: int, needed: int) -> None:
        table = self.tables[group]
        width = max(needed, 2 * table.shape[1])
        grown = torch.zeros(table.shape[0], width, dtype=torch.int64, device=self.device)
        grown[:, :table.shape[1]] = table
        self.tables[group] = grown
