"""One manager per KV cache group: the group's block table per request, over the shared BlockPool.

A table is indexed by block position; None marks a position whose block went back to the pool because
no future query can see it (a sliding window moved past it). The coordinator calls every manager with
the same token counts; a manager knows only its kind's rules: which blocks a request still needs and
which cached prefix it can reuse (vLLM's SingleTypeKVCacheManager).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from vllmpy.engine.kv_cache import BlockHash, BlockKey, BlockPool, KVBlock
from vllmpy.engine.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, cdiv

# Block index -> the key its cached block must carry (built lazily: only candidates pay for it).
KeyOf = Callable[[int], BlockKey]
# What a table position that holds no block reads as. Kernels start at the window, so it is never read.
PLACEHOLDER_ID = 0


class SingleTypeManager(ABC):
    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group: int) -> None:
        self.spec = spec
        self.pool = pool
        self.group = group
        self.block_size = spec.block_size
        self.tables: dict[str, list[KVBlock | None]] = {}

    def block_ids(self, req_id: str, start: int = 0) -> list[int]:
        """The request's table entries from position `start` on."""
        return [PLACEHOLDER_ID if block is None else block.block_id for block in self.tables.get(req_id, [])[start:]]

    @abstractmethod
    def find_hit(self, hashes: Sequence[BlockHash], max_blocks: int, key_of: KeyOf) -> list[KVBlock | None]:
        """The longest usable cached prefix of at most max_blocks blocks, one entry per position."""

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Return blocks no query after `num_computed_tokens` can read (none, unless the kind drops some)."""

    def num_blocks_to_allocate(self, req_id: str, num_tokens: int, hits: Sequence[KVBlock | None]) -> int:
        """Pool blocks that covering num_tokens takes: new blocks, plus hits that sit free now."""
        num_positions = len(self.tables.get(req_id, ())) + len(hits)
        num_revived = sum(1 for block in hits if block is not None and block.ref_cnt == 0)
        return max(0, cdiv(num_tokens, self.block_size) - num_positions) + num_revived

    def add_hits(self, req_id: str, hits: Sequence[KVBlock | None]) -> None:
        """Start the request's table with its prefix hit (before any group allocates, which could evict it)."""
        self.pool.touch(block for block in hits if block is not None)
        self.tables[req_id] = list(hits)

    def allocate(self, req_id: str, num_tokens: int) -> None:
        table = self.tables.setdefault(req_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(table)
        if num_new > 0:
            table.extend(self.pool.allocate(num_new))

    def cache_blocks(self, req_id: str, hashes: Sequence[BlockHash], keys: Sequence[BlockKey], start: int) -> None:
        """Publish blocks start.. start+len(keys) (full and computed) under this group. Placeholders all
        sit before `start`: a hit's are counted as published, and a window drops a block only after the
        step that filled it has published it."""
        table = self.tables[req_id]
        for offset, key in enumerate(keys):
            self.pool.cache_block(table[start + offset], hashes[start + offset], key, self.group)

    def trim(self, req_id: str, num_tokens: int) -> list[KVBlock]:
        """Drop the table's blocks past the first num_tokens tokens (they hold only rejected drafts, never
        published); returns them, last first, for the pool."""
        table = self.tables.get(req_id)
        keep = cdiv(num_tokens, self.block_size)
        if not table or len(table) <= keep:
            return []
        dropped = table[keep:]
        del table[keep:]
        return [block for block in reversed(dropped) if block is not None]

    def pop(self, req_id: str) -> list[KVBlock | None]:
        return self.tables.pop(req_id, [])

    def _cached(self, hashes: Sequence[BlockHash], index: int, key_of: KeyOf) -> KVBlock | None:
        block = self.pool.get_cached_block(hashes[index], self.group)
        # Same hash, different content is a collision, not a hit.
        return block if block is not None and block.key == key_of(index) else None


class FullAttentionManager(SingleTypeManager):
    """Keeps every block; a hit is the run of cached blocks from the start (hashes chain, so the first
    miss ends it)."""

    def find_hit(self, hashes: Sequence[BlockHash], max_blocks: int, key_of: KeyOf) -> list[KVBlock | None]:
        blocks: list[KVBlock | None] = []
        for index in range(max_blocks):
            block = self._cached(hashes, index, key_of)
            if block is None:
                break
            blocks.append(block)
        return blocks


class SlidingWindowManager(SingleTypeManager):
    """Holds only the window: blocks before it go back to the pool as the request moves on, and a hit
    needs only the blocks the window can still see."""

    def __init__(self, spec: SlidingWindowSpec, pool: BlockPool, group: int) -> None:
        super().__init__(spec, pool, group)
        self.window = spec.sliding_window
        # Blocks the next query reads besides its own position's (the hit ends on a block boundary).
        self.hit_span = cdiv(self.window - 1, self.block_size)

    def find_hit(self, hashes: Sequence[BlockHash], max_blocks: int, key_of: KeyOf) -> list[KVBlock | None]:
        """Scan from the end for hit_span cached blocks in a row; earlier positions stay placeholders."""
        if self.hit_span == 0:  # a window of one token reads nothing cached
            return [None] * max_blocks
        blocks: list[KVBlock | None] = [None] * max_blocks
        run = 0
        for index in range(max_blocks - 1, -1, -1):
            block = self._cached(hashes, index, key_of)
            if block is None:
                run = 0
                continue
            blocks[index] = block
            run += 1
            if run == self.hit_span:
                return blocks[:index + run]
        return blocks[:run]  # a shorter run from block 0 holds everything its window sees

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        table = self.tables.get(req_id)
        if not table:
            return
        # The next query (position num_computed_tokens) sees keys from num_computed_tokens - window + 1.
        first_visible = max(0, num_computed_tokens - self.window + 1) // self.block_size
        freed = []
        for index in range(first_visible - 1, -1, -1):
            block = table[index]
            if block is None:  # everything before was dropped by an earlier call or is a hit's placeholder
                break
            freed.append(block)
            table[index] = None
        self.pool.free(freed)


class SeatManager:
    """Recurrent-state seats: one per running request, taken at its first allocation and given back when
    it finishes, aborts or is preempted (it then recomputes its state from scratch). A seat indexes every
    recurrent layer's state tensors, so one manager serves all recurrent layers."""

    def __init__(self, num_seats: int) -> None:
        self.num_seats = num_seats
        self._free = list(range(num_seats - 1, -1, -1))  # lowest seat handed out first
        self.seats: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def assign(self, req_id: str) -> None:
        if req_id not in self.seats:
            self.seats[req_id] = self._free.pop()

    def release(self, req_id: str) -> None:
        seat = self.seats.pop(req_id, None)
        if seat is not None:
            self._free.append(seat)


MANAGERS: dict[type[KVCacheSpec], type[SingleTypeManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def manager_for(spec: KVCacheSpec, pool: BlockPool, group: int) -> SingleTypeManager:
    # The nearest registered kind in the spec's class tree (MLA's latent spec is a full-attention spec).
    manager_cls = next((MANAGERS[cls] for cls in type(spec).__mro__ if cls in MANAGERS), None)
    if manager_cls is None:
        raise ValueError(f"no KV cache manager for {type(spec).__name__}; known: "
                         f"{', '.join(cls.__name__ for cls in MANAGERS)}")
    return manager_cls(spec, pool, group)
