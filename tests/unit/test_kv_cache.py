"""BlockPool ref counts and eviction order; the coordinator's prefix caching and allocation (one
full-attention group: tests/unit/test_kv_cache_groups.py covers several)."""
import pytest

from tests.kv_harness import kv_config
from vllmpy.engine import kv_cache
from vllmpy.engine.kv_cache import BlockPool, hash_block_tokens
from vllmpy.engine.kv_cache_coordinator import KVCacheCoordinator
from vllmpy.engine.request import Request
from vllmpy.sampling_params import SamplingParams

BS = 4


def make_manager(num_blocks: int, enable_caching: bool) -> KVCacheCoordinator:
    return KVCacheCoordinator(kv_config(num_blocks, BS), enable_caching)


def table_ids(manager: KVCacheCoordinator, req_id: str) -> list[int]:
    (table,) = manager.block_ids(req_id)
    return table


def lookup(manager: KVCacheCoordinator, request: Request) -> tuple[list, int]:
    """The prefix hit of the one group."""
    (blocks,), num_cached = manager.get_computed_blocks(request)
    return blocks, num_cached


def make_request(req_id: str, tokens: list[int], **params) -> Request:
    return Request(req_id, tokens, SamplingParams(**params))


def run_prefill(manager: KVCacheCoordinator, request: Request) -> None:
    """Allocate and 'compute' the whole prompt, publishing its full blocks."""
    blocks, num_cached = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_cached, blocks)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)


def fake_key(n: int):
    return (bytes(32), (n,), ())


def test_refcounts_and_touch():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.allocate(2)
    assert (a.ref_cnt, b.ref_cnt, pool.num_free_blocks) == (1, 1, 2)
    pool.touch([a])
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2  # still shared: not free
    pool.free([a, b])
    assert a.ref_cnt == 0 and pool.num_free_blocks == 4
    # A free cached block that is touched leaves the free queue without losing its hash.
    c = pool.allocate(1)[0]
    pool.cache_block(c, b"h" * 32, fake_key(1))
    pool.free([c])
    pool.touch([c])
    assert c.ref_cnt == 1 and pool.num_free_blocks == 3 and c.block_hash == b"h" * 32


def test_eviction_least_recently_freed_first_and_drops_hash():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks):
        pool.cache_block(block, bytes([i]) * 32, fake_key(i))
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[3], blocks[1]])
    evicted = pool.allocate(4)
    assert [b.block_id for b in evicted] == [2, 0, 3, 1]
    assert all(b.block_hash is None for b in evicted)
    assert pool.get_cached_block(bytes([0]) * 32) is None


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3, enable_caching=True)
    cached, plain_a, plain_b = pool.allocate(3)
    pool.cache_block(cached, b"c" * 32, fake_key(7))
    pool.free([cached])
    pool.free([plain_a])
    pool.free([plain_b])
    assert [b.block_id for b in pool.allocate(3)] == [plain_b.block_id, plain_a.block_id, cached.block_id]


def test_request_tail_blocks_evicted_first():
    manager = make_manager(6, True)
    request = make_request("a", list(range(12)))  # three full blocks
    run_prefill(manager, request)
    ids = table_ids(manager, "a")
    assert len(ids) == 3
    manager.free(request)
    assert manager.num_free_blocks == 6
    # The three untouched blocks come first, then the request's blocks, last block first.
    order = [b.block_id for b in manager.pool.allocate(6)]
    assert order[3:] == ids[::-1]


def test_chain_hash_depends_on_parent_and_extra_keys():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4]) and len(h1) == 32
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], ("lora-a",)) != h1
    assert hash_block_tokens(None, [1, 2, 3, 5]) != h1


def test_prefix_hit_never_covers_whole_prompt():
    manager = make_manager(10, True)
    run_prefill(manager, make_request("a", list(range(8))))
    blocks, num_cached = lookup(manager, make_request("b", list(range(8))))
    assert num_cached == 4 and len(blocks) == 1  # the last token must still be computed
    blocks, num_cached = lookup(manager, make_request("c", list(range(9))))
    assert num_cached == 8
    blocks, num_cached = lookup(manager, make_request("d", [0, 1, 2, 99, 4, 5, 6, 7, 8]))
    assert num_cached == 0


def test_prefix_hit_shares_blocks_and_counts_tokens():
    manager = make_manager(10, True)
    first = make_request("a", list(range(10)))
    run_prefill(manager, first)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (10, 0)
    second = make_request("b", list(range(9)) + [77])
    blocks, num_cached = lookup(manager, second)
    assert num_cached == 8
    assert manager.allocate_slots(second, second.num_tokens - num_cached, (blocks,))
    assert table_ids(manager, "b")[:2] == table_ids(manager, "a")[:2]
    assert table_ids(manager, "b")[2] != table_ids(manager, "a")[2]
    assert [b.ref_cnt for b in blocks] == [2, 2]
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (20, 8)


def test_forced_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(kv_cache, "hash_block_tokens", lambda *args, **kwargs: b"\x01" * 32)
    manager = make_manager(10, True)
    run_prefill(manager, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same hash for every block, different tokens: must be a miss.
    assert lookup(manager, make_request("b", [9, 9, 9, 9, 9, 9, 9, 9, 9])) == ([], 0)
    # Same tokens still hit the block that owns the hash.
    blocks, num_cached = lookup(manager, make_request("c", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert num_cached == 4 and blocks[0].block_id == table_ids(manager, "a")[0]


def test_same_block_under_different_prefixes_is_cached_separately():
    manager = make_manager(10, True)
    run_prefill(manager, make_request("a", [1, 1, 1, 1, 5, 6, 7, 8, 0]))
    run_prefill(manager, make_request("b", [2, 2, 2, 2, 5, 6, 7, 8, 0]))
    blocks, num_cached = lookup(manager, make_request("c", [2, 2, 2, 2, 5, 6, 7, 8, 9]))
    assert num_cached == 8 and [b.block_id for b in blocks] == table_ids(manager, "b")[:2]


def test_generated_tokens_are_cached_too():
    manager = make_manager(10, True)
    request = make_request("a", [1, 2, 3])
    run_prefill(manager, request)
    for token in (4, 5, 6):  # decode: append the sampled token, compute it next step
        request.append_output_token(token)
        assert manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        manager.cache_blocks(request, request.num_computed_tokens)
    blocks, num_cached = lookup(manager, make_request("b", [1, 2, 3, 4, 5]))
    assert num_cached == 4 and blocks[0].block_id == table_ids(manager, "a")[0]


def test_prompt_logprobs_skips_lookup():
    manager = make_manager(10, True)
    run_prefill(manager, make_request("a", list(range(9))))
    assert lookup(manager, make_request("b", list(range(9)), prompt_logprobs=1)) == ([], 0)


def test_allocate_fails_atomically_when_short():
    manager = make_manager(3, False)
    request = make_request("a", list(range(13)))
    assert not manager.allocate_slots(request, 13)  # needs 4 blocks
    assert manager.num_free_blocks == 3 and table_ids(manager, "a") == []
    assert manager.allocate_slots(request, 12)
    assert manager.num_free_blocks == 0 and manager.usage == pytest.approx(1.0)


def test_caching_disabled_never_hits():
    manager = make_manager(10, False)
    run_prefill(manager, make_request("a", list(range(9))))
    assert lookup(manager, make_request("b", list(range(9)))) == ([], 0)
    assert manager.prefix_cache_queries == 0


def test_reset_prefix_cache_refused_while_in_use():
    manager = make_manager(10, True)
    request = make_request("a", list(range(9)))
    run_prefill(manager, request)
    assert not manager.reset_prefix_cache()
    manager.free(request)
    assert manager.reset_prefix_cache()
    assert lookup(manager, make_request("b", list(range(9)))) == ([], 0)
