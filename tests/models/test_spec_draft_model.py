"""draft_model speculation end to end: a second checkpoint drafts greedily, batched, on its own KV cache, and
greedy spec-on gives spec-off's tokens (strict, or a near-tie of spec-off, DESIGN.md).

A draft with the target's own weights is accepted almost always; a different tiny draft of the same vocabulary
mostly not; a GGUF draft loads through the same loader; a draft of another vocabulary and
draft_tensor_parallel_size 2 are refused at startup, naming what differs.
"""
from __future__ import annotations

import gguf
import pytest

from tests.gguf.test_gguf_archs import _TOKENIZER_KEYS
from tests.gguf.test_gguf_loader import _f32, _hparams, _weights, _write
from tests.models.test_batch_invariance import _agree
from tests.models.test_spec_decode import PROMPTS, _params, _respec, _run, _small_vocab_llama, _spec_off
from tests.tiny_models import make_tiny_checkpoint

K = 4
MAX_MODEL_LEN = 64


def _draft_llm(target: str, draft: str, **kwargs):
    from vllmpy import LLM

    return LLM(model=target, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=4, speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": K}, **kwargs)


def _compare(llm, label: str, prompts=PROMPTS, **overrides) -> None:
    reference = _spec_off(llm, lambda: llm.generate(prompts, _params(**overrides), use_tqdm=False))
    _agree([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in reference], _run(llm, prompts, **overrides), label)


def _proposer(llm):
    return llm.engine.core.scheduler.drafter.proposer


def _assert_draft_freed(llm) -> None:
    proposer = _proposer(llm)
    assert not proposer._seqs and proposer.kv.num_free_blocks == proposer.kv.num_blocks


@pytest.fixture(scope="module")
def target(smollm2_tokenizer_dir, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("target_llama")
    make_tiny_checkpoint("LlamaForCausalLM", smollm2_tokenizer_dir, out)
    return str(out)


def test_same_weights_draft_is_accepted_and_lossless(target):
    """The target as its own draft: mean acceptance length > k/2, spec-off's tokens, pools freed after."""
    llm = _draft_llm(target, target, num_blocks=128)
    stats = llm.engine.core.scheduler.drafter.stats
    _compare(llm, "same-weights draft")
    print(f"acceptance {stats.acceptance_rate:.2f}, mean length {stats.mean_acceptance_length:.2f}")
    assert stats.num_drafts > 0 and stats.mean_acceptance_length > K / 2
    assert llm.engine.core.scheduler.kv.num_free_blocks == llm.engine.core.num_blocks
    _assert_draft_freed(llm)


def test_other_draft_mixed_batch_chunked_and_preempted(target, smollm2_tokenizer_dir, tmp_path):
    """A different architecture as draft (Qwen3, same tokenizer): prompts caught up in chunks of 8 tokens, a
    target pool so small that requests are preempted (their draft blocks freed and re-prefilled)."""
    make_tiny_checkpoint("Qwen3ForCausalLM", smollm2_tokenizer_dir, tmp_path)
    llm = _draft_llm(target, str(tmp_path), num_blocks=128, max_num_batched_tokens=8)
    runner = _proposer(llm).runner
    forwards, original = [], runner.execute
    runner.execute = lambda so: forwards.append(so) or original(so)
    stats = llm.engine.core.scheduler.drafter.stats
    _compare(llm, "other draft")
    assert stats.num_draft_tokens > 0
    assert any(not c.sample for so in forwards for c in so.chunks), "no prompt was caught up in chunks"
    assert max(len(so.chunks) for so in forwards) > 1, "the draft never ran batched"

    blocks = llm.engine.core.kv_cache_config.layout.blocks_per_request(MAX_MODEL_LEN, 8)
    scheduler = _respec(llm, num_blocks=blocks, max_num_batched_tokens=8, enable_prefix_caching=False)
    preempted = []
    proposer = _proposer(llm)
    original_preempt = proposer.on_request_preempted
    proposer.on_request_preempted = lambda req_id: preempted.append(req_id) or original_preempt(req_id)
    _compare(llm, "other draft, tiny pool")
    assert scheduler.stats().num_preemptions > 0 and preempted, "the tiny pool caused no preemption"
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    _assert_draft_freed(llm)


def test_pool_budget_split_by_bytes_per_sequence():
    """One budget, two pools holding the same number of tokens; --num-blocks N gives each N blocks."""
    import torch

    from vllmpy.config import CacheConfig
    from vllmpy.engine.kv_cache_spec import FullAttentionSpec, KVCacheLayout
    from vllmpy.runner.memory import size_kv_pools

    big = KVCacheLayout.from_specs([FullAttentionSpec(16, 4, 64, torch.float32)] * 4, 256)
    small = KVCacheLayout.from_specs([FullAttentionSpec(16, 2, 64, torch.float32)] * 2, 256)  # 1/4 of the bytes
    budget = 100 * big.block_bytes
    target, draft = size_kv_pools(CacheConfig(kv_cache_memory=budget), big, small, 0, 256, 64)
    assert target.num_blocks == draft.num_blocks == 80
    assert target.num_blocks * big.block_bytes + draft.num_blocks * small.block_bytes <= budget
    assert "80% of the budget" in target.info and draft.info.startswith("draft model KV cache: 80 blocks")
    auto = size_kv_pools(CacheConfig(), big, small, 10 * budget, 256, 64, max_num_seqs=4)
    assert auto[0].num_blocks == auto[1].num_blocks == 4 * 16  # both capped at 4 sequences of 16 blocks
    fixed = size_kv_pools(CacheConfig(num_blocks=40), big, small, 0, 256, 64)
    assert fixed[0].num_blocks == fixed[1].num_blocks == 40
    assert size_kv_pools(CacheConfig(num_blocks=40), big, None, 0, 256, 64)[1] is None


def _gguf_llama(path, vocab: dict, swap: tuple[int, int] | None = None):
    """A random llama GGUF with SmolLM2's vocabulary (two tokens swapped, if asked)."""
    tokens = list(vocab["tokenizer.ggml.tokens"])
    if swap:
        a, b = swap
        tokens[a], tokens[b] = tokens[b], tokens[a]
    metadata = _hparams("llama") | {key: value for key, value in vocab.items()} | {"tokenizer.ggml.tokens": tokens}
    return _write(path, "llama", metadata, _f32(_weights(vocab=len(tokens))))


@pytest.fixture(scope="module")
def smollm2_vocab(smollm2_gguf_path) -> dict:
    reader = gguf.GGUFReader(smollm2_gguf_path)
    return {key: reader.fields[key].contents() for key in _TOKENIZER_KEYS}


def test_gguf_draft(target, smollm2_vocab, tmp_path):
    llm = _draft_llm(target, str(_gguf_llama(tmp_path / "draft.gguf", smollm2_vocab)), num_blocks=128)
    _compare(llm, "gguf draft", PROMPTS[:3])
    assert llm.engine.core.scheduler.drafter.stats.num_draft_tokens > 0
    _assert_draft_freed(llm)


def test_refusals(target, smollm2_tokenizer_dir, smollm2_vocab, tmp_path):
    """Another vocabulary size, the same size with other tokens, a missing path, draft_tensor_parallel_size 2."""
    from vllmpy import LLM

    small = tmp_path / "small"
    make_tiny_checkpoint("LlamaForCausalLM", smollm2_tokenizer_dir, small, make_config=_small_vocab_llama)
    with pytest.raises(ValueError, match=r"draft model vocabulary \(16\) differs from the target's \(49152\)"):
        _draft_llm(target, str(small), num_blocks=64)
    swapped = _gguf_llama(tmp_path / "swapped.gguf", smollm2_vocab, swap=(1000, 1001))
    with pytest.raises(ValueError, match="draft model vocabulary differs from the target's at token id 1000"):
        _draft_llm(target, str(swapped), num_blocks=64)
    with pytest.raises(ValueError, match="draft model '.*missing': --model .*no such file"):
        _draft_llm(target, str(tmp_path / "missing"), num_blocks=64)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1"):
        LLM(model=target, speculative_config={"model": target, "num_speculative_tokens": 2,
                                              "draft_tensor_parallel_size": 2})


def test_default_model_drafts_for_itself():
    """The default model (Gemma 3 270M GGUF) as its own draft, one short prompt: spec-off's tokens. One
    intra-op thread: on the loaded 2-core host two spin against each other (8 tokens: 14 s vs 1.6 s seen)."""
    import torch

    from vllmpy import LLM

    k = 3
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(max_model_len=64, num_blocks=16, speculative_config={
            "method": "draft_model", "model": _default_path(), "num_speculative_tokens": k})
        _compare(llm, "default model", ["The lighthouse keeper walked along the beach and"], max_tokens=8)
    finally:
        torch.set_num_threads(threads)
    assert llm.engine.core.scheduler.drafter.stats.mean_acceptance_length > k / 2


def _default_path() -> str:
    from vllmpy.loader.default_model import default_model_path

    return default_model_path()
