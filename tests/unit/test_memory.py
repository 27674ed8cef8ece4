"""KV pool sizing arithmetic and the pre-flight refusal."""
import pytest

from vllmpy.config import CacheConfig
from vllmpy.errors import KVCacheTooSmallError
from vllmpy.runner.memory import (
    AUTO_KV_FRACTION,
    available_memory_bytes,
    kv_bytes_per_block,
    resolve_num_blocks,
)

BPB = kv_bytes_per_block(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype_bytes=2)


def test_bytes_per_block_counts_k_v_and_every_layer():
    assert BPB == 2 * 4 * 16 * 2 * 64 * 2


def test_kv_cache_memory_budget_is_never_exceeded():
    budget = 1_000_000
    num_blocks, info = resolve_num_blocks(CacheConfig(kv_cache_memory=budget), BPB, 10**12, 256, 16)
    assert num_blocks * BPB <= budget < (num_blocks + 1) * BPB
    assert f"{num_blocks} blocks" in info and f"{num_blocks * 16} tokens" in info
    assert f"{num_blocks * BPB} bytes" in info and "--kv-cache-memory" in info


def test_num_blocks_wins():
    num_blocks, info = resolve_num_blocks(CacheConfig(num_blocks=40, kv_cache_memory=1), BPB, 0, 256, 16)
    assert num_blocks == 40 and "--num-blocks" in info


def test_auto_uses_fraction_of_available_and_caps_at_max_num_seqs():
    available = 200 * BPB
    num_blocks, info = resolve_num_blocks(CacheConfig(), BPB, available, 256, 16)
    assert num_blocks == int(available * AUTO_KV_FRACTION) // BPB
    assert "auto" in info
    num_blocks, info = resolve_num_blocks(CacheConfig(), BPB, available, 256, 16, max_num_seqs=2)
    assert num_blocks == 2 * 256 // 16 and "capped" in info


def test_preflight_refusal_shows_arithmetic_and_flags():
    budget = 10 * BPB + 5
    with pytest.raises(KVCacheTooSmallError) as excinfo:
        resolve_num_blocks(CacheConfig(kv_cache_memory=budget), BPB, 10**12, 4096, 16)
    message = str(excinfo.value)
    for part in ("10 blocks x 16 tokens = 160 tokens", "max_model_len 4096", f"{BPB} bytes per block",
                 str(budget), "--kv-cache-memory", "--num-blocks", "--max-model-len",
                 str(256 * BPB), "at least 256"):
        assert part in message, part
    assert isinstance(excinfo.value, ValueError)


def test_preflight_applies_to_num_blocks_and_auto():
    with pytest.raises(KVCacheTooSmallError, match="3 blocks x 16 tokens = 48 tokens"):
        resolve_num_blocks(CacheConfig(num_blocks=3), BPB, 0, 64, 16)
    with pytest.raises(KVCacheTooSmallError, match="available"):
        resolve_num_blocks(CacheConfig(), BPB, BPB, 64, 16)


def test_available_memory_on_cpu_is_positive():
    assert available_memory_bytes("cpu") > 0
