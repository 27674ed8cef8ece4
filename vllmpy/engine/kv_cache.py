"""Paged KV cache bookkeeping: a ref-counted block pool with an LRU free queue, and the chained content
hash that lets full blocks be shared (automatic prefix caching).

Pure Python: block ids only. The runner owns the tensors; a block id indexes one page of every layer in
the KV cache group that holds it (kv_cache_spec.py). Every block is usable (no reserved null block):
--num-blocks N means N blocks of real capacity. Per-request block tables live in kv_cache_managers.py.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

BlockHash = bytes
# Everything a cached block must match for a hash hit to count: (parent hash, token ids, extra keys).
BlockKey = tuple[BlockHash, tuple[int, ...], tuple]

# A block's own extra keys from its token range [start, end) (image content hashes).
PositionKeys = Callable[[int, int], tuple]

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


def extend_chain_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        num_blocks: int, extra_keys: tuple = (), position_keys: PositionKeys | None = None
                        ) -> list[BlockHash]:
    """Grow `hashes` (a request's chain so far) to its first `num_blocks` full blocks. `extra_keys` (the
    request's LoRA adapter) go into every block's hash, as vLLM's: two adapters never share a block.
    `position_keys(start, end)` adds a block's own keys (the images its positions show)."""
    for index in range(len(hashes), num_blocks):
        parent = hashes[-1] if hashes else None
        keys = _block_keys(extra_keys, position_keys, block_size, index)
        hashes.append(hash_block_tokens(parent, token_ids[index * block_size:(index + 1) * block_size], keys))
    return hashes


def block_key(hashes: Sequence[BlockHash], token_ids: Sequence[int], block_size: int, index: int,
              extra_keys: tuple = (), position_keys: PositionKeys | None = None) -> BlockKey:
    """What block `index` of this chain must match: its parent's hash, its own tokens, its extra keys."""
    parent = hashes[index - 1] if index else _ROOT_HASH
    return (parent, tuple(token_ids[index * block_size:(index + 1) * block_size]),
            _block_keys(extra_keys, position_keys, block_size, index))


def _block_keys(extra_keys: tuple, position_keys: PositionKeys | None, block_size: int, index: int) -> tuple:
    if position_keys is None:
        return extra_keys
    return extra_keys + position_keys(index * block_size, (index + 1) * block_size)


class KVBlock:
    """One block of `block_size` token slots (one page in each layer of the group holding it)."""

    __slots__ = ("block_hash", "block_id", "group", "key", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set while the block is in the prefix cache
        self.group = 0  # the KV cache group whose prefix cache lists it
        self.key: BlockKey | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Owns every block: reference counts, the free queue and the (group, hash) -> block map.

    Each group caches under its own entry: the same tokens are different pages in different groups.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks, next to evict first. An OrderedDict gives O(1) removal from the middle when a
        # free block comes back as a prefix-cache hit, and O(1) push at either end.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[tuple[int, BlockHash], KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free blocks that still cache a prefix count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVBlock | None:
        """The group's block holding this hash; the caller still compares its key (hashes can collide)."""
        return self._cached.get((group, block_hash))

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

    def cache_block(self, block: KVBlock, block_hash: BlockHash, key: BlockKey, group: int = 0) -> None:
        """Publish a full block. If another block already holds this hash it keeps the entry."""
        if not self.enable_caching or block.block_hash is not None or (group, block_hash) in self._cached:
            return
        block.block_hash, block.key, block.group = block_hash, key, group
        self._cached[(group, block_hash)] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            self._uncache(block)
        return True

    def _uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[(block.group, block.block_hash)]
            block.block_hash = block.key = None
