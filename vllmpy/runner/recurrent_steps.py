"""The runner's recurrent-state work around each forward (layers/recurrent_state.py is the layers' side).

Before the forward: a seat whose request starts its sequence is zeroed; one resuming a prefix-cache hit
is filled from the hit's snapshot (a state row past the seats); the states the step wants mid-chunk are
planned: at the snapshot boundaries a prefill chunk crosses (written to the snapshot rows the scheduler
reserved) and after every token of a speculative verification row (kept). A verification row leaves the
seat at the state after all of its drafts; the state after its last accepted token is committed into the
seat when the request's next chunk arrives, whose start position is the verified length (the scheduler
rolled num_computed_tokens back to it). Committing from that, not from this runner's own sampling, keeps
every runner that holds the layers in step, including tensor-parallel workers, which never sample.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllmpy.engine.schedule_types import ScheduledChunk
from vllmpy.layers.recurrent_state import RecurrentMetadata, RecurrentState


@dataclass
class _Verified:
    start_pos: int  # the verification chunk's first position
    kept: list[tuple[torch.Tensor, torch.Tensor]]  # (state tensor, its states after each of the chunk's tokens)


class RecurrentSteps:
    def __init__(self, states: list[RecurrentState], num_seats: int, device: torch.device) -> None:
        self.tensors = [tensor for state in states for tensor in state]
        self.num_seats = num_seats  # snapshot slot s is state row num_seats + s
        self.device = device
        self._verified: dict[str, _Verified] = {}
        self._step: tuple[list[ScheduledChunk], RecurrentMetadata] | None = None

    def forget(self, req_id: str) -> None:
        """The request finished or was preempted: its kept verification states are dropped."""
        self._verified.pop(req_id, None)

    def metadata(self, chunks: list[ScheduledChunk], seats: list[int]) -> RecurrentMetadata:
        """The step's RecurrentMetadata, with every seat ready for the forward to continue from."""
        self._commit(chunks, seats)
        fresh: list[int] = []
        resumed: list[tuple[int, int]] = []  # (seat, snapshot row)
        wanted: dict[int, list[int]] = {}
        targets: dict[int, list[int]] = {}
        for row, (chunk, seat) in enumerate(zip(chunks, seats)):
            if chunk.start_pos == 0:
                fresh.append(seat)
            if chunk.resume_snapshot is not None:
                resumed.append((seat, self.num_seats + chunk.resume_snapshot))
            if chunk.num_draft_tokens:
                wanted[row] = list(range(1, len(chunk.token_ids) + 1))
            elif chunk.save_snapshots:
                wanted[row] = [offset for offset, _ in chunk.save_snapshots]
                targets[row] = [self.num_seats + slot for _, slot in chunk.save_snapshots]
        self._reset(fresh, resumed)
        meta = RecurrentMetadata.build(seats, [c.start_pos for c in chunks], [len(c.token_ids) for c in chunks],
                                       self.device, wanted, targets)
        self._step = (chunks, meta)
        return meta

    def after_forward(self) -> None:
        """Hold the step's verification states until each request's next chunk says what was accepted."""
        if self._step is None:
            return
        chunks, meta = self._step
        for row, kept in meta.kept.items():
            self._verified[chunks[row].req_id] = _Verified(chunks[row].start_pos, kept)
        self._step = None

    def _commit(self, chunks: list[ScheduledChunk], seats: list[int]) -> None:
        for chunk, seat in zip(chunks, seats):
            verified = self._verified.pop(chunk.req_id, None)
            if verified is None:
                continue
            last = chunk.start_pos - verified.start_pos - 1  # the last verified token of that chunk
            for tensor, states in verified.kept:
                tensor[seat] = states[last]

    def _reset(self, fresh: list[int], resumed: list[tuple[int, int]]) -> None:
        """Zero the seats that start a sequence (they may hold a finished request's state) and copy each
        resumed hit's snapshot into its seat."""
        if fresh:
            index = torch.tensor(fresh, dtype=torch.int64, device=self.device)
            for tensor in self.tensors:
                tensor.index_fill_(0, index, 0)
        if resumed:
            seats, rows = (torch.tensor(list(column), dtype=torch.int64, device=self.device)
                           for column in zip(*resumed))
            for tensor in self.tensors:
                tensor.index_copy_(0, seats, tensor.index_select(0, rows))
