"""Paged KV cache bookkeeping: a ref-counted block pool with an LRU free queue, and per-request block
tables with automatic prefix caching (full blocks shared through a chained content hash).

Pure Python: block ids only. The runner owns the tensors; one block id indexes every layer's cache.
Every block is usable (no reserved null block): --num-blocks N means N blocks of real capacity.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from vllmpy.engine.request import Request

BlockHash = bytes
# Everything a cached block must match for a hash hit to count: (parent hash, token ids, extra keys).
BlockKey = tuple[BlockHash, tuple[int, ...], tuple]

_ROOT_HASH = bytes(32)  # parent of a request's first block; fixed width keeps the encoding unambiguous


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple = ()) -> BlockHash:
    """SHA-256 of (parent hash, token ids, extra keys such as a LoRA name or cache salt).

    sha256 rather than hash(): it ignores PYTHONHASHSEED (same value in every process, so hashes can be
    logged or exported), and at 256 bits a collision is negligible, which is what lets a hit compare the
    parent's hash instead of the parent's tokens. No pickle: tokens are packed as int64.
    """
    digest = hashlib.sha256(parent_hash or _ROOT_HASH)
    digest.update(array("q", token_ids).tobytes())
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return digest.digest()


class KVBlock:
    """One block of `block_size` token slots (in every layer's cache)."""

    __slots__ = ("block_hash", "block_id", "key", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set while the block is in the prefix cache
        self.key: BlockKey | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Owns every block: reference counts, the free queue and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks, next to evict first. An OrderedDict gives O(1) removal from the middle when a
        # free block comes back as a prefix-cache hit, and O(1) push at either end.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free blocks that still cache a prefix count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block holding this hash; the caller still compares its key (hashes can collide)."""
        return self._cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take blocks from the head of the free queue, dropping whatever prefix each one cached."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} KV blocks with only {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._uncache(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Share blocks found in the prefix cache; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order they should be evicted.

        A block that caches a prefix joins the tail (evicted last, LRU). One that caches nothing
        (partial, or caching off) joins the head: it is worthless to keep, so it is reused first.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVBlock, block_hash: BlockHash, key: BlockKey) -> None:
        """Publish a full block. If another block already holds this hash it keeps the entry."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash, block.key = block_hash, key
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            self._uncache(block)
        return True

    def _uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = block.key = None


class KVCacheManager:
    """Per-request block tables on top of a BlockPool, plus the prefix-cache lookup.

    Blocks are published to the cache once their tokens are computed (`cache_blocks`), for prompt and
    generated tokens alike, so a preempted request or a follow-up turn can find them.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # chain hashes of the request's full blocks
        self._num_published: dict[str, int] = {}  # leading blocks already offered to the cache
        self.prefix_cache_queries = 0  # tokens looked up, counted once per admission
        self.prefix_cache_hits = 0  # of those, tokens found in the cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's tokens, as (blocks, num_tokens). Pure lookup.

        Never the whole sequence: the last token must be computed to have logits to sample from.
        Skipped for prompt_logprobs, which need every prompt position computed (as vLLM).
        """
        if not self._looks_up(request):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._chain_hashes(request, max_blocks)
        blocks = []
        for index in range(max_blocks):
            block = self.pool.get_cached_block(hashes[index])
            # Same hash, different content: a collision, not a hit. The key is built only for a
            # candidate, so a miss costs one dict lookup.
            if block is None or block.key != self._key(request, index, hashes):
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[KVBlock] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens; False (nothing taken) if short.

        `computed_blocks` is the prefix hit from get_computed_blocks, passed on the request's first
        allocation (its num_computed_tokens still excludes them).
        """
        req_id = request.request_id
        num_held = len(self._blocks.get(req_id, ()))
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_needed = max(0, -(-num_tokens // self.block_size) - num_held - len(computed_blocks))
        num_revived = sum(1 for block in computed_blocks if block.ref_cnt == 0)  # hits that sit free
        if num_needed + num_revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(computed_blocks)  # before allocate(), which could otherwise evict them
        if req_id not in self._blocks:  # first allocation: the prefix lookup counts now, once
            self._record_lookup(request, len(computed_blocks))
            self._num_published[req_id] = len(computed_blocks)
            self._blocks[req_id] = list(computed_blocks)
        self._blocks[req_id].extend(self.pool.allocate(num_needed))
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's blocks that became full now that `num_computed_tokens` are computed."""
        if not self.enable_caching:
            return
        num_full = num_computed_tokens // self.block_size
        start = self._num_published.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._chain_hashes(request, num_full)
        blocks = self._blocks[request.request_id]
        for index in range(start, num_full):
            self.pool.cache_block(blocks[index], hashes[index], self._key(request, index, hashes))
        self._num_published[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release all of the request's blocks (finished, aborted or preempted)."""
        blocks = self._blocks.pop(request.request_id, [])
        self._hashes.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)
        # Tail first: a request's last blocks are the least likely to be shared, so evict them first.
        self.pool.free(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _looks_up(self, request: Request) -> bool:
        params = request.sampling_params  # None for a pooling request
        return self.enable_caching and (params is None or params.prompt_logprobs is None)

    def _record_lookup(self, request: Request, num_hit_blocks: int) -> None:
        if self._looks_up(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_blocks * self.block_size

    def _chain_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Hashes of the first `num_blocks` full blocks, extended incrementally as tokens arrive."""
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens, size = request.all_token_ids, self.block_size
        for index in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[index * size:(index + 1) * size]))
        return hashes

    def _key(self, request: Request, index: int, hashes: list[BlockHash]) -> BlockKey:
        parent = hashes[index - 1] if index else _ROOT_HASH
        tokens = request.all_token_ids[index * self.block_size:(index + 1) * self.block_size]
        return parent, tuple(tokens), ()
