"""Where a data-parallel request goes: the least-loaded live engine, unless another live engine already
holds the request's prompt prefix (prefix-cache affinity).

The frontend cannot see the engines' block pools, so it keeps, per engine, an LRU of the block-hash chains
of the prompts it sent there (capacity: that engine's KV blocks, the most it can hold cached). A prompt's
match on an engine is the number of its leading full blocks found there.

Rule: the engine with the longest match wins unless its load exceeds AFFINITY_LOAD_FACTOR times the
least-loaded engine's plus AFFINITY_LOAD_SLACK requests; then (and without any match) the least-loaded
engine wins, ties going round-robin so that an idle pool spreads sequential requests. Load is the
frontend's own count of unfinished sequences it placed on an engine (a request with n=4 counts 4): the
engines' running + waiting, without the lag of their reports (a burst that arrives between two reports
would otherwise land on one engine).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

AFFINITY_LOAD_FACTOR = 2
AFFINITY_LOAD_SLACK = 4


def block_hashes(token_ids: list[int], block_size: int, salt: int = 0) -> list[int]:
    """The hash chain of the prompt's full blocks: block i's hash covers blocks 0..i (and `salt`, the
    LoRA adapter id, whose blocks the engine caches apart)."""
    hashes, parent = [], hash(("vllmpy-dp", salt))
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


@dataclass
class _Placement:
    engine: int
    weight: int


class PrefixAffinityRouter:
    """Thread-safe: requests are placed from the server's event loop and released from the engines'
    reader threads."""

    def __init__(self, capacities: list[int], block_size: int) -> None:
        self.block_size = block_size
        self._capacities = capacities
        self._cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in capacities]
        self._loads = [0] * len(capacities)
        self._alive = [True] * len(capacities)
        self._placements: dict[str, _Placement] = {}
        self._next_tie = 0
        self._lock = threading.Lock()

    def place(self, request_id: str, token_ids: list[int] | None, weight: int = 1, salt: int = 0) -> int:
        """The engine `request_id` goes to (counted as `weight` sequences until released); raises
        LookupError when no engine is alive."""
        hashes = block_hashes(token_ids, self.block_size, salt) if token_ids else []
        with self._lock:
            engine = self._choose(hashes)
            self._remember(engine, hashes)
            self._loads[engine] += weight
            self._placements[request_id] = _Placement(engine, weight)
            return engine

    def release(self, request_id: str) -> int | None:
        """The engine a finished or aborted request was on (None if it was not placed, or released)."""
        with self._lock:
            placement = self._placements.pop(request_id, None)
            if placement is None:
                return None
            self._loads[placement.engine] -= placement.weight
            return placement.engine

    def mark_dead(self, engine: int) -> list[str]:
        """Route nothing more to `engine`; returns (and releases) the requests that were on it."""
        with self._lock:
            self._alive[engine] = False
            self._cached[engine].clear()
            lost = [rid for rid, p in self._placements.items() if p.engine == engine]
            for rid in lost:
                del self._placements[rid]
            self._loads[engine] = 0
            return lost

    def loads(self) -> list[int]:
        with self._lock:
            return list(self._loads)

    def _choose(self, hashes: list[int]) -> int:
        live = [i for i, alive in enumerate(self._alive) if alive]
        if not live:
            raise LookupError("no data parallel engine is alive")
        least = min(self._loads[i] for i in live)
        matches = {i: self._match(i, hashes) for i in live}
        best = max(live, key=lambda i: (matches[i], -self._loads[i]))
        if matches[best] > 0 and self._loads[best] <= AFFINITY_LOAD_FACTOR * least + AFFINITY_LOAD_SLACK:
            return best
        ties = [i for i in live if self._loads[i] == least]
        self._next_tie += 1
        return ties[self._next_tie % len(ties)]

    def _match(self, engine: int, hashes: list[int]) -> int:
        cached = self._cached[engine]
        count = 0
        for h in hashes:
            if h not in cached:
                break
            count += 1
        return count

    def _remember(self, engine: int, hashes: list[int]) -> None:
        cached = self._cached[engine]
        for h in hashes:
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self._capacities[engine]:
            cached.popitem(last=False)
