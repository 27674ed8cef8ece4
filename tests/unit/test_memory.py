"""KV pool sizing arithmetic and the pre-flight refusal."""
import pytest
import torch

from vllmpy.config import CacheConfig
from vllmpy.engine.kv_cache_spec import FullAttentionSpec, KVCacheLayout, SlidingWindowSpec
from vllmpy.errors import KVCacheTooSmallError, UnsupportedCheckpointError
from vllmpy.runner.memory import AUTO_KV_FRACTION, available_memory_bytes, resolve_num_blocks

FULL = FullAttentionSpec(16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
LAYOUT = KVCacheLayout.from_specs([FULL] * 4, max_model_len=4096)
BPB = LAYOUT.block_bytes
CHUNK = 2048  # --max-num-batched-tokens


def resolve(cache_config: CacheConfig, available: int, max_model_len: int, layout: KVCacheLayout = LAYOUT, **kw):
    return resolve_num_blocks(cache_config, layout, available, max_model_len, CHUNK, **kw)


def test_bytes_per_block_counts_k_v_and_every_layer():
    assert BPB == 2 * 4 * 16 * 2 * 64 * 2


def test_sliding_layers_share_the_pool_and_hold_only_their_window():
    # Gemma 3's shape: 5 sliding layers per full one. Groups of 1 layer: a block is one layer's page.
    sliding = SlidingWindowSpec(16, 2, 64, torch.bfloat16, sliding_window=512)
    layout = KVCacheLayout.from_specs([sliding] * 5 + [FULL], max_model_len=32768)
    assert len(layout.groups) == 6 and layout.layers_per_group == 1
    assert layout.block_bytes == BPB // 4
    # A full-length sequence: 2048 blocks in the full group; a window of 511 older keys plus a 2048-token
    # chunk in each sliding group (161 = ceil(2559 / 16) + 1 for a window start inside a block).
    assert layout.blocks_per_request(32768, CHUNK) == 2048 + 5 * 161
    # --num-blocks stays per layer: every layer can hold that many blocks, so the pool has 6x.
    num_blocks, info = resolve(CacheConfig(num_blocks=2048), 0, 32768, layout)
    assert num_blocks == 6 * 2048 and "--num-blocks 2048 per layer x 6 groups" in info
    assert "sliding window 512 x5 (up to 161 blocks/seq each)" in info
    assert "full attention x1 (up to 2048 blocks/seq each)" in info
    assert "fits 4 sequences of 32768 tokens" in info
    with pytest.raises(KVCacheTooSmallError, match="needs 2853 blocks") as excinfo:
        resolve(CacheConfig(kv_cache_memory=2852 * layout.block_bytes), 0, 32768, layout)
    message = str(excinfo.value)
    assert "--num-blocks to at least 476" in message  # 6 x 476 >= 2853
    fits = int(message.split("--max-model-len to ")[1].split()[0])
    assert layout.blocks_per_request(fits, CHUNK) <= 2852 < layout.blocks_per_request(fits + 1, CHUNK)


def test_window_as_long_as_the_context_groups_with_full_attention():
    sliding = SlidingWindowSpec(16, 2, 64, torch.bfloat16, sliding_window=512)
    layout = KVCacheLayout.from_specs([sliding, FULL, sliding, FULL], max_model_len=512)
    assert [len(g.layers) for g in layout.groups] == [4] and layout.groups[0].spec == FULL


def test_layers_of_different_page_sizes_are_refused():
    other = FullAttentionSpec(16, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16)
    sliding = SlidingWindowSpec(16, 2, 64, torch.bfloat16, sliding_window=8)
    with pytest.raises(UnsupportedCheckpointError, match="same KV heads, head_dim and cache dtype"):
        KVCacheLayout.from_specs([sliding, other], max_model_len=64)


def test_kv_cache_memory_budget_is_never_exceeded():
    budget = 1_000_000
    num_blocks, info = resolve(CacheConfig(kv_cache_memory=budget), 10**12, 256)
    assert num_blocks * BPB <= budget < (num_blocks + 1) * BPB
    assert f"{num_blocks} blocks" in info and f"{num_blocks * 16} tokens" in info
    assert f"{num_blocks * BPB} bytes" in info and "--kv-cache-memory" in info


def test_num_blocks_wins():
    num_blocks, info = resolve(CacheConfig(num_blocks=40, kv_cache_memory=1), 0, 256)
    assert num_blocks == 40 and "--num-blocks" in info


def test_auto_uses_fraction_of_available_and_caps_at_max_num_seqs():
    available = 200 * BPB
    num_blocks, info = resolve(CacheConfig(), available, 256)
    assert num_blocks == int(available * AUTO_KV_FRACTION) // BPB
    assert "auto" in info
    num_blocks, info = resolve(CacheConfig(), available, 256, max_num_seqs=2)
    assert num_blocks == 2 * 256 // 16 and "capped" in info


def test_preflight_refusal_shows_arithmetic_and_flags():
    budget = 10 * BPB + 5
    with pytest.raises(KVCacheTooSmallError) as excinfo:
        resolve(CacheConfig(kv_cache_memory=budget), 10**12, 4096)
    message = str(excinfo.value)
    for part in ("10 blocks x 16 tokens = 160 tokens", "max_model_len 4096 needs 256 blocks", f"{BPB} bytes per block",
                 str(budget), "--kv-cache-memory", "--num-blocks", "--max-model-len to 160 or less",
                 str(256 * BPB), "at least 256"):
        assert part in message, part
    assert isinstance(excinfo.value, ValueError)


def test_preflight_applies_to_num_blocks_and_auto():
    with pytest.raises(KVCacheTooSmallError, match="3 blocks x 16 tokens = 48 tokens"):
        resolve(CacheConfig(num_blocks=3), 0, 64)
    with pytest.raises(KVCacheTooSmallError, match="available"):
        resolve(CacheConfig(), BPB, 64)


def test_available_memory_on_cpu_is_positive():
    assert available_memory_bytes("cpu") > 0
