"""Prefix caching for recurrent layers: snapshots of a sequence's recurrent state at prompt boundaries.

A cached prefix of KV blocks says nothing about the recurrent state after it, so a model with recurrent
layers can resume a prefix hit only where a snapshot of that state exists (vLLM's mamba_cache_mode
"align" idea). Snapshots are slots of seat-shaped state (rows past the seats in every recurrent layer's
tensors, runner/recurrent_steps.py), taken every SNAPSHOT_SPAN tokens of a prefill and keyed like the
block that ends there: its chain hash (all tokens before it, LoRA, images) and its BlockKey (a hash
collision is not a hit). A hit is the longest prefix every attention group holds that ends on a
snapshot. Pure bookkeeping here; the layers write and the runner copies the states.

Granularity: a boundary every ceil(64 / block_size) blocks (64 tokens at the default block size 16), not
every block. One snapshot costs a whole sequence's state (21 MiB on Granite-4.0-H-350M shapes, 80x the
256 KiB of KV its 64 tokens hold), so per-block snapshots would cache 4x fewer prefixes in the same bytes
for a hit at most 48 tokens longer; recomputing under 64 tokens is a small part of any prefill.

A slot is reserved when a chunk that crosses its boundary is scheduled, filled by that step's forward,
and published once the step's tokens are computed (cache_blocks); a preempted or aborted request gives
its unpublished slots back. Published slots are evicted least recently used first (a hit refreshes one).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllmpy.engine.kv_cache import BlockHash, BlockKey
from vllmpy.engine.kv_cache_spec import cdiv

SNAPSHOT_SPAN = 64  # tokens: the most a hit falls short of the cached prefix


@dataclass(frozen=True)
class _Snapshot:
    num_blocks: int  # the boundary, in blocks
    block_hash: BlockHash
    key: BlockKey
    slot: int


class SnapshotPool:
    def __init__(self, num_slots: int, block_size: int) -> None:
        self.num_slots = num_slots
        self.block_size = block_size
        self.blocks_per_snapshot = cdiv(SNAPSHOT_SPAN, block_size)
        # Slots that may be taken, next first: free ones at the front, published ones in LRU order.
        self._lru: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(num_slots))
        self._cached: dict[BlockHash, _Snapshot] = {}
        self._by_slot: dict[int, _Snapshot] = {}  # published slots
        self._pending: dict[str, list[_Snapshot]] = {}  # reserved, being written by the request's step
        self.hits = 0  # admissions resumed from a snapshot
        self.taken = 0  # snapshots written and published since start (a released reservation is not one)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_reserved(self) -> int:
        """Slots held by running requests' steps, not yet published (0 when the engine is idle)."""
        return sum(len(pending) for pending in self._pending.values())

    def find(self, hashes: Sequence[BlockHash], max_blocks: int, key_of: Callable[[int], BlockKey]
             ) -> tuple[int, int | None]:
        """(blocks, slot) of the longest snapshot within the first max_blocks blocks; (0, None) if none."""
        for num_blocks in range(max_blocks - max_blocks % self.blocks_per_snapshot, 0, -self.blocks_per_snapshot):
            snapshot = self._cached.get(hashes[num_blocks - 1])
            if snapshot is not None and snapshot.key == key_of(num_blocks - 1):
                return num_blocks, snapshot.slot
        return 0, None

    def resume(self, slot: int) -> None:
        """An admitted request resumes from this slot: count the hit, evict it last."""
        self.hits += 1
        self._lru.move_to_end(slot)

    def boundaries(self, start: int, end: int) -> list[int]:
        """Snapshot boundaries (in blocks) of the tokens [start, end): those after a token in the range."""
        span = self.blocks_per_snapshot * self.block_size
        return [tokens // self.block_size for tokens in range((start // span + 1) * span, end + 1, span)]

    def reserve(self, req_id: str, boundaries: Sequence[int], hashes: Sequence[BlockHash],
                keys: Sequence[BlockKey]) -> list[tuple[int, int]]:
        """Slots for the boundaries not cached or being written yet, as (boundary in blocks, slot); none
        once every slot is pending (the pool evicts published snapshots only)."""
        writing = {s.block_hash for pending in self._pending.values() for s in pending}
        taken = []
        for num_blocks, block_hash, key in zip(boundaries, hashes, keys):
            if block_hash in self._cached or block_hash in writing or not self._lru:
                continue
            slot, _ = self._lru.popitem(last=False)
            self._evict(slot)
            self._pending.setdefault(req_id, []).append(_Snapshot(num_blocks, block_hash, key, slot))
            taken.append((num_blocks, slot))
        return taken

    def publish(self, req_id: str, num_computed_blocks: int) -> None:
        """Make the request's snapshots up to this many computed blocks findable."""
        pending = self._pending.get(req_id)
        if not pending:
            return
        done = [s for s in pending if s.num_blocks <= num_computed_blocks]
        self._pending[req_id] = [s for s in pending if s.num_blocks > num_computed_blocks]
        for snapshot in done:
            self._cached[snapshot.block_hash] = self._by_slot[snapshot.slot] = snapshot
            self._lru[snapshot.slot] = None
        self.taken += len(done)

    def release(self, req_id: str) -> None:
        """The request left before its reserved snapshots were computed: their slots are free again."""
        for snapshot in self._pending.pop(req_id, []):
            self._lru[snapshot.slot] = None
            self._lru.move_to_end(snapshot.slot, last=False)

    def reset(self) -> None:
        """Forget every published snapshot (reset_prefix_cache)."""
        for slot in list(self._by_slot):
            self._evict(slot)
            self._lru.move_to_end(slot, last=False)

    def _evict(self, slot: int) -> None:
        snapshot = self._by_slot.pop(slot, None)
        if snapshot is not None:
            del self._cached[snapshot.block_hash]
