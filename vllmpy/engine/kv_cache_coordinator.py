"""The scheduler's one view of the KV cache: every group's manager over one BlockPool.

The scheduler asks for a request's prefix hit, allocates slots, publishes computed blocks and frees;
the coordinator answers for all groups at once and never lets the scheduler see a layer kind. A prefix
hit is the longest length every group can serve (each kind decides what it needs to hold for it).
Allocation is all or nothing across groups. Blocks are published to the cache once their tokens are
computed, for prompt and generated tokens alike, so a preempted request or a follow-up turn finds them.
A model with recurrent layers also needs a free seat to admit a request; its block table has one more
"group" at the end whose one entry is that seat (vLLM's Mamba manager holds one block per request). With
caching on, its prefix hits must also end on a snapshot of the recurrent state (engine/recurrent_snapshots.py):
the hit then carries one more list, one entry per hit block, the last holding the snapshot's slot.
The runner keeps every table across steps, so each step hands it only the entries added since the last
(`new_block_ids`): a step's message stays the same size however long the contexts grow.
"""
from __future__ import annotations

from collections.abc import Sequence

from vllmpy.engine.kv_cache import BlockHash, BlockKey, BlockPool, KVBlock, block_key, extend_chain_hashes
from vllmpy.engine.kv_cache_managers import SeatManager, manager_for
from vllmpy.engine.kv_cache_spec import KVCacheConfig, cdiv
from vllmpy.engine.recurrent_snapshots import SnapshotPool
from vllmpy.engine.request import Request

# One list per group, one entry per block position (None: a position the group need not hold); then, for
# a model with recurrent layers, the hit's snapshot: [None] * (blocks - 1) + [slot] ([] without a hit).
GroupBlocks = tuple[list[KVBlock | None], ...]


class KVCacheCoordinator:
    def __init__(self, config: KVCacheConfig, enable_caching: bool) -> None:
        self.block_size = config.block_size
        self.enable_caching = enable_caching
        # A model without attention layers holds no blocks; one unused block keeps the pool's accounting defined.
        self.pool = BlockPool(max(config.num_blocks, 1), enable_caching)
        self.managers = tuple(manager_for(group.spec, self.pool, index) for index, group in enumerate(config.groups))
        self.seats = SeatManager(config.num_seats) if config.layout.recurrent else None
        self.snapshots = SnapshotPool(config.num_snapshots, self.block_size) \
            if self.seats is not None and enable_caching else None
        self._no_hit: GroupBlocks = tuple([] for _ in range(len(self.managers) + (self.snapshots is not None)))
        self._resume: dict[str, int] = {}  # admitted on a snapshot hit: the slot its first chunk resumes from
        self._state_bytes = config.layout.state_bytes_per_seq
        self._hashes: dict[str, list[BlockHash]] = {}  # chain hashes of the request's full blocks
        # Leading blocks already offered to the cache; a request is known here from its first allocation.
        self._num_published: dict[str, int] = {}
        self._num_sent: dict[str, list[int]] = {}  # per group, leading table entries new_block_ids handed out
        self.prefix_cache_queries = 0  # tokens looked up, counted once per admission
        self.prefix_cache_hits = 0  # of those, tokens found in the cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def snapshot_hits(self) -> int:
        return 0 if self.snapshots is None else self.snapshots.hits

    @property
    def snapshot_bytes(self) -> int:
        return 0 if self.snapshots is None else self.snapshots.num_cached * self._state_bytes

    @property
    def snapshots_taken(self) -> int:
        return 0 if self.snapshots is None else self.snapshots.taken

    @property
    def snapshot_slots(self) -> int:
        return 0 if self.snapshots is None else self.snapshots.num_slots

    @property
    def usage(self) -> float:
        if not self.managers and self.seats is not None:  # recurrent layers only: the seats are the pool
            return 1.0 - self.seats.num_free / self.seats.num_seats
        return self.pool.usage

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table in every group (then its seat, for a model with recurrent layers)."""
        tables = tuple(manager.block_ids(request_id) for manager in self.managers)
        return tables if self.seats is None else (*tables, [self.seats.seats[request_id]])

    def new_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Each group's table entries added since the last call for this request (the whole table on the
        first call after its allocation starts or it was freed), then its seat, whole, every time."""
        sent = self._num_sent.setdefault(request_id, [0] * len(self.managers))
        tables = tuple(manager.block_ids(request_id, start) for manager, start in zip(self.managers, sent))
        for group, table in enumerate(tables):
            sent[group] += len(table)
        return tables if self.seats is None else (*tables, [self.seats.seats[request_id]])

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Longest cached prefix every group can serve, as (blocks per group, num_tokens). Pure lookup.

        Never the whole sequence: the last token must be computed to have logits to sample from.
        Skipped for prompt_logprobs, which need every prompt position computed (as vLLM).
        """
        if not self._looks_up(request):
            return self._no_hit, 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._chain_hashes(request, max_blocks)
        keys: dict[int, BlockKey] = {}

        def key_of(index: int) -> BlockKey:
            if index not in keys:
                keys[index] = block_key(hashes, request.all_token_ids, self.block_size, index,
                                        request.block_extra_keys, request.image_keys)
            return keys[index]

        # Each group may shorten the hit; a shorter length must be rechecked by the others (a window's
        # blocks are not a prefix), until every group agrees. Recurrent layers need a snapshot at its end.
        num_blocks = max_blocks
        while True:
            hits = tuple(manager.find_hit(hashes, num_blocks, key_of) for manager in self.managers)
            shortest = min((len(blocks) for blocks in hits), default=num_blocks)
            if self.snapshots is not None:
                shortest, slot = self.snapshots.find(hashes, shortest, key_of)
                hits += ([None] * (shortest - 1) + [slot] if shortest else [],)
            if shortest == num_blocks:
                return hits, num_blocks * self.block_size
            num_blocks = shortest

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: GroupBlocks = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens in every group; False (nothing taken)
        if the pool is short. Blocks no future query can see are returned first either way.

        `computed_blocks` is the prefix hit from get_computed_blocks, passed on the request's first
        allocation (its num_computed_tokens still excludes them).
        """
        req_id = request.request_id
        hits = computed_blocks or self._no_hit
        num_hit_blocks = len(hits[0]) if hits else 0
        num_computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        num_tokens = num_computed + num_new_tokens
        for manager in self.managers:
            manager.remove_skipped_blocks(req_id, num_computed)
        needed = sum(manager.num_blocks_to_allocate(req_id, num_tokens, blocks)
                     for manager, blocks in zip(self.managers, hits))
        if needed > self.pool.num_free_blocks:
            return False
        first = req_id not in self._num_published
        if first and self.seats is not None:
            if not self.seats.num_free:
                return False
            self.seats.assign(req_id)
        if first:  # take the hit, count the lookup, once
            for manager, blocks in zip(self.managers, hits):
                manager.add_hits(req_id, blocks)
            if self.snapshots is not None and num_hit_blocks:
                self._resume[req_id] = hits[-1][-1]
                self.snapshots.resume(hits[-1][-1])
            self._record_lookup(request, num_hit_blocks)
            self._num_published[req_id] = num_hit_blocks
        for manager in self.managers:
            manager.allocate(req_id, num_tokens)
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's blocks that became full now that `num_computed_tokens` are computed."""
        if not self.enable_caching:
            return
        num_full = num_computed_tokens // self.block_size
        if self.snapshots is not None:
            self.snapshots.publish(request.request_id, num_full)
        start = self._num_published.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._chain_hashes(request, num_full)
        keys = [block_key(hashes, request.all_token_ids, self.block_size, index, request.block_extra_keys,
                          request.image_keys) for index in range(start, num_full)]
        for manager in self.managers:
            manager.cache_blocks(request.request_id, hashes, keys, start)
        self._num_published[request.request_id] = num_full

    def snapshot_plan(self, request: Request, start: int, num_new: int,
                      num_drafts: int) -> tuple[int | None, list[tuple[int, int]]]:
        """For a chunk of `num_new` tokens from `start`: the snapshot slot its seat resumes from (a prefix
        hit's first chunk) and (tokens into the chunk, slot) for each snapshot boundary it crosses. Only
        prefill chunks of several tokens take snapshots (a decode's one token crosses a boundary rarely,
        and a verification row's state is not final)."""
        if self.snapshots is None:
            return None, []
        resume = self._resume.pop(request.request_id, None)
        if num_new < 2 or num_drafts:
            return resume, []
        boundaries = self.snapshots.boundaries(start, start + num_new)
        if not boundaries:
            return resume, []
        hashes = self._chain_hashes(request, boundaries[-1])
        keys = [block_key(hashes, request.all_token_ids, self.block_size, b - 1, request.block_extra_keys,
                          request.image_keys) for b in boundaries]
        taken = self.snapshots.reserve(request.request_id, boundaries, [hashes[b - 1] for b in boundaries], keys)
        return resume, [(b * self.block_size - start, slot) for b, slot in taken]

    def trim(self, request: Request, num_tokens: int) -> bool:
        """Return the blocks past the request's first `num_tokens` tokens in every group: speculation
        allocated them for drafts the verifier rejected. True if any table got shorter."""
        dropped = [block for manager in self.managers for block in manager.trim(request.request_id, num_tokens)]
        self.pool.free(dropped)
        sent = self._num_sent.get(request.request_id)
        if dropped and sent is not None:  # entries written again at those positions are new
            self._num_sent[request.request_id] = [min(n, cdiv(num_tokens, self.block_size)) for n in sent]
        return bool(dropped)

    def free(self, request: Request) -> None:
        """Release all of the request's blocks in every group (finished, aborted or preempted)."""
        tables = [manager.pop(request.request_id) for manager in self.managers]
        self._hashes.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)
        self._num_sent.pop(request.request_id, None)
        self.pool.free(_tail_first(tables))
        if self.seats is not None:
            self.seats.release(request.request_id)
        if self.snapshots is not None:
            self.snapshots.release(request.request_id)
            self._resume.pop(request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        if self.snapshots is not None:
            self.snapshots.reset()
        return True

    def _looks_up(self, request: Request) -> bool:
        return self.enable_caching and (request.is_pooling or request.sampling_params.prompt_logprobs is None)

    def _record_lookup(self, request: Request, num_hit_blocks: int) -> None:
        if self._looks_up(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_blocks * self.block_size

    def _chain_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Hashes of the first `num_blocks` full blocks, extended incrementally as tokens arrive."""
        hashes = self._hashes.setdefault(request.request_id, [])
        return extend_chain_hashes(hashes, request.all_token_ids, self.block_size, num_blocks, request.block_extra_keys,
                                   request.image_keys)


def _tail_first(tables: Sequence[list[KVBlock | None]]) -> list[KVBlock]:
    """Blocks in eviction order: the last position of every group first. A request's last blocks are
    the least likely to be shared, and a hit needs its position in every group."""
    length = max((len(table) for table in tables), default=0)
    return [table[index] for index in range(length - 1, -1, -1) for table in tables
            if index < len(table) and table[index] is not None]
