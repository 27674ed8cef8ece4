"""Recurrent state as a cache kind: what a state-space / linear-attention layer keeps per sequence.

The contract every recurrent family (Mamba2, Gated DeltaNet, short conv) codes against:
- A layer module with recurrent state has `recurrent_state_spec(self, ssm_dtype) -> RecurrentStateSpec`:
  its per-sequence tensors (e.g. the conv window [kernel - 1, conv_dim] in the model dtype and the SSM /
  delta-rule matrix in `ssm_dtype`, --mamba-ssm-cache-dtype, float32 by default).
- `CausalLM.kv_cache_specs()` returns one spec per stateful layer in forward order: attention specs for
  attention layers, a RecurrentStateSpec for recurrent ones. `forward(input_ids, positions, kv_caches,
  meta)` gets, per recurrent layer, a RecurrentState (one tensor per spec shape, [num_seats, *shape])
  and the step's RecurrentMetadata (one for every recurrent layer).
- A layer reads and writes its seats in place: chunk i continues seat `seat_ids[i]`'s state when
  `has_initial_state[i]` (its start position is > 0, so chunked prefill carries the state across steps),
  else starts from zeros. The runner zeroes those fresh seats before the forward, so a layer may always
  continue from the seat. A seat is a running request's for its whole life (assigned at admission,
  freed at finish, abort or preemption; a preempted request recomputes from scratch).
- Seats come out of the KV pool's byte budget (runner/memory.py), before its blocks.
- A step may want a chunk's state in the middle of it (`RecurrentMetadata.wanted`): at prefix-cache
  snapshot boundaries (written to snapshot rows of the same tensors, past the seats) and after every
  token of a verification row (speculative decoding: kept for the runner, which commits the accepted
  position's into the seat). A layer's prefill path computes the states at those offsets and hands them
  to `store` (its conv windows to `store_windows`); offsets are tokens into the chunk, 1..length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# One tensor per spec shape, [num_seats, *shape]: a layer's state for every seat.
RecurrentState = list[torch.Tensor]


@dataclass(frozen=True)
class RecurrentStateSpec:
    """The fixed-size state one layer keeps per sequence, whatever its length."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    label: str = "recurrent"  # the kind, as the INFO lines name it ("Mamba2", "GDN")

    def __post_init__(self) -> None:
        if len(self.shapes) != len(self.dtypes) or not self.shapes:
            raise ValueError(f"a recurrent state needs one dtype per shape, got {len(self.shapes)} shapes and "
                             f"{len(self.dtypes)} dtypes")

    @property
    def bytes_per_seq(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(self.shapes, self.dtypes))

    def allocate(self, num_seats: int, device: torch.device) -> RecurrentState:
        return [torch.zeros(num_seats, *shape, dtype=dtype, device=device)
                for shape, dtype in zip(self.shapes, self.dtypes)]


@dataclass
class RecurrentMetadata:
    """The step's batch as recurrent layers read it: which seat each chunk owns and where its tokens are.

    Built once per step for every recurrent layer; the host lists drive the per-sequence prefill loop,
    the tensors index the seats (as AttentionMetadata keeps both).
    """

    seat_ids: torch.Tensor  # int64 [num_chunks] the seat of each chunk's request
    seats: list[int]  # the same seats, on the host (the prefill loop indexes by them)
    query_start_loc: list[int]  # [num_chunks + 1] offsets of each chunk's tokens in the flat batch
    query_start_loc_tensor: torch.Tensor  # int32 [num_chunks + 1], the same offsets
    has_initial_state: torch.Tensor  # bool [num_chunks]: start_pos > 0, continue the seat's state
    decode_rows: list[int] = field(default_factory=list)  # chunks of exactly one token
    prefill_rows: list[int] = field(default_factory=list)  # chunks of more than one token
    # chunk row -> offsets (tokens into the chunk, ascending) after which its states are wanted
    wanted: dict[int, list[int]] = field(default_factory=dict)
    # chunk row -> the state row (a snapshot slot past the seats) each wanted state is written to; a wanted
    # row absent here is a verification row, whose states are kept in `kept` instead
    targets: dict[int, list[int]] = field(default_factory=dict)
    # verification row -> (state tensor, its states at the wanted offsets [n, *shape]) for every tensor
    kept: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    decode_seats: torch.Tensor = field(init=False)  # int64 [D] seats of the decode rows
    decode_tokens: torch.Tensor = field(init=False)  # int64 [D] flat index of each decode row's token

    def __post_init__(self) -> None:
        device, rows = self.seat_ids.device, self.decode_rows
        index = torch.tensor(rows, dtype=torch.int64, device=device)
        self.decode_seats = self.seat_ids.index_select(0, index)
        self.decode_tokens = torch.tensor([self.query_start_loc[r] for r in rows], dtype=torch.int64, device=device)

    @classmethod
    def build(cls, seats: list[int], start_positions: list[int], query_lens: list[int], device: torch.device,
              wanted: dict[int, list[int]] | None = None, targets: dict[int, list[int]] | None = None
              ) -> RecurrentMetadata:
        query_start_loc = [0]
        for n in query_lens:
            query_start_loc.append(query_start_loc[-1] + n)
        return cls(seat_ids=torch.tensor(seats, dtype=torch.int64, device=device), seats=list(seats),
                   query_start_loc=query_start_loc,
                   query_start_loc_tensor=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
                   has_initial_state=torch.tensor([p > 0 for p in start_positions], dtype=torch.bool, device=device),
                   decode_rows=[i for i, n in enumerate(query_lens) if n == 1],
                   prefill_rows=[i for i, n in enumerate(query_lens) if n > 1], wanted=wanted or {},
                   targets=targets or {})

    @property
    def num_chunks(self) -> int:
        return len(self.query_start_loc) - 1

    def is_verification(self, row: int) -> bool:
        """A speculative verification row: decoded token by token semantically (no prompt-only clamps)."""
        return row in self.wanted and row not in self.targets

    def store(self, tensor: torch.Tensor, row: int, states: list[torch.Tensor]) -> None:
        """The row's states at its wanted offsets (in order) for one of a layer's state tensors."""
        if row in self.targets:  # snapshots: one copy each, straight into its slot
            for target, state in zip(self.targets[row], states, strict=True):
                tensor[target] = state
        else:
            self.kept.setdefault(row, []).append((tensor, torch.stack(states).to(tensor.dtype)))

    def store_windows(self, conv_state: torch.Tensor, windows: torch.Tensor, inputs: torch.Tensor) -> None:
        """Conv windows at the wanted offsets: the last W - 1 inputs before each, from the chunk's window
        before the step (`windows`, one per chunk) and its conv inputs (`inputs`, the flat batch)."""
        keep = windows.shape[1]
        for row, offsets in self.wanted.items():
            lo, hi = self.query_start_loc[row], self.query_start_loc[row + 1]
            line = torch.cat((windows[row].to(inputs.dtype), inputs[lo:hi]))
            self.store(conv_state, row, [line[o:o + keep] for o in offsets])
