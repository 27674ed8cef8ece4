"""Data-parallel routing (distributed/dp_router.py): least-loaded with round-robin ties, prefix affinity
unless the holder is much busier, nothing routed to a dead engine."""
from __future__ import annotations

import pytest

from vllmpy.distributed.dp_router import AFFINITY_LOAD_SLACK, PrefixAffinityRouter, block_hashes

PROMPT = list(range(100, 164))  # 4 full blocks of 16


def test_hash_chains_cover_full_blocks_and_their_prefix():
    hashes = block_hashes(PROMPT + [1, 2, 3], 16)
    assert len(hashes) == 4  # the 3-token tail is no full block
    assert block_hashes(PROMPT[:32] + [7] * 32, 16)[:2] == hashes[:2]
    assert block_hashes([7] * 16 + PROMPT[16:], 16)[1] != hashes[1]  # a block's hash covers its prefix
    assert block_hashes(PROMPT, 16, salt=3)[0] != hashes[0]  # another LoRA adapter caches apart


def test_idle_engines_take_turns_and_load_decides():
    router = PrefixAffinityRouter([64, 64], 16)
    first, second = router.place("a", None), router.place("b", None)
    assert {first, second} == {0, 1}
    router.place("c", None, weight=3)
    assert router.loads() in ([4, 1], [1, 4])
    busy = router.loads().index(4)
    assert router.place("d", None) == 1 - busy
    assert router.release("c") == busy and router.release("c") is None


def test_a_prompt_goes_back_to_the_engine_holding_its_prefix():
    router = PrefixAffinityRouter([64, 64], 16)
    home = router.place("a", PROMPT)
    router.release("a")
    for i in range(4):  # sequential repeats: the idle tie would alternate, affinity keeps them home
        assert router.place(f"r{i}", PROMPT[:48] + [5] * 20) == home
        router.release(f"r{i}")


def test_affinity_yields_to_a_much_less_loaded_engine():
    router = PrefixAffinityRouter([64, 64], 16)
    home = router.place("a", PROMPT)
    router.place("busy", PROMPT, weight=AFFINITY_LOAD_SLACK - 1)  # affinity: home's load is now the slack
    assert router.loads() == [AFFINITY_LOAD_SLACK if e == home else 0 for e in (0, 1)]
    assert router.place("near", PROMPT) == home  # load 4 <= 2 * 0 + 4
    assert router.place("far", PROMPT) == 1 - home  # load 5 > AFFINITY_LOAD_FACTOR * 0 + 4


def test_dead_engines_lose_their_requests_and_get_no_more():
    router = PrefixAffinityRouter([64, 64], 16)
    home = router.place("a", PROMPT)
    assert router.mark_dead(home) == ["a"]
    assert router.place("b", PROMPT) == 1 - home
    router.mark_dead(1 - home)
    with pytest.raises(LookupError, match="no data parallel engine is alive"):
        router.place("c", PROMPT)


def test_the_lru_holds_no_more_blocks_than_the_engine():
    """A 4-block prompt in a 2-block pool keeps only its last blocks, so its first is not held: no affinity,
    and repeats take turns."""
    router = PrefixAffinityRouter([2, 2], 16)
    router.place("a", PROMPT)
    router.release("a")
    placed = set()
    for rid in ("b", "c"):
        placed.add(router.place(rid, PROMPT))
        router.release(rid)
    assert placed == {0, 1}
