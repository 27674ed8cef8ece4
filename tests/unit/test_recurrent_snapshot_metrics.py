"""/metrics for hybrid models' prefix caching: the recurrent-state snapshot pool's size, the bytes its
published snapshots hold, snapshots taken and hits, read from a tiny Granite 4.0-H engine after real
requests, summed and per engine under data parallel, and absent on a model without a snapshot pool."""
from __future__ import annotations

import dataclasses

from tests.models.test_hybrid_mamba import granite_hybrid
from tests.tiny_models import make_tiny_checkpoint

# 140 prompt tokens: snapshot boundaries at 64 and 128 (engine/recurrent_snapshots.py SNAPSHOT_SPAN)
PROMPT = {"prompt_token_ids": [10 + (7 * i) % 500 for i in range(140)]}


def _sample(text: str, name: str, labels: str = 'model_name="m"') -> float:
    """The value of `name{labels}` in Prometheus text (fails when the sample is missing)."""
    prefix = f"{name}{{{labels}}} "
    (value,) = [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]
    return float(value)


def test_snapshot_stats_are_scraped_after_hybrid_requests(smollm2_tokenizer_dir, tmp_path):
    from vllmpy import LLM, SamplingParams
    from vllmpy.metrics import ServerMetrics

    make_tiny_checkpoint("GraniteMoeHybridForCausalLM", smollm2_tokenizer_dir, tmp_path, granite_hybrid)
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=256, block_size=16, num_blocks=64,
              max_num_seqs=2, recurrent_snapshot_fraction=0.5)
    metrics = ServerMetrics(llm.engine.stats, "m")
    slots = llm.engine.core.scheduler.kv.snapshots.num_slots
    state_bytes = llm.engine.core.kv_cache_config.layout.state_bytes_per_seq
    params = SamplingParams(temperature=0.0, max_tokens=2)

    text = metrics.render().decode()
    assert _sample(text, "vllm:recurrent_snapshot_slots") == slots >= 2
    assert _sample(text, "vllm:recurrent_snapshots_taken_total") == 0
    llm.generate([PROMPT], params, use_tqdm=False)
    text = metrics.render().decode()
    assert _sample(text, "vllm:recurrent_snapshots_taken_total") == 2  # at 64 and 128 tokens
    assert _sample(text, "vllm:recurrent_snapshot_hits_total") == 0
    assert _sample(text, "vllm:recurrent_snapshot_bytes") == 2 * state_bytes
    (again,) = llm.generate([PROMPT], params, use_tqdm=False)
    text = metrics.render().decode()
    assert again.num_cached_tokens == 128
    assert _sample(text, "vllm:recurrent_snapshot_hits_total") == 1
    assert _sample(text, "vllm:recurrent_snapshots_taken_total") == 2  # the repeat's boundaries were cached

    engines = [llm.engine.stats(), dataclasses.replace(llm.engine.stats(), recurrent_snapshot_hits=4)]
    text = ServerMetrics(lambda: engines, "m").render().decode()
    assert _sample(text, "vllm:recurrent_snapshot_hits_total") == 5
    assert _sample(text, "vllm:recurrent_snapshot_hits_total", 'engine="1",model_name="m"') == 4
    assert _sample(text, "vllm:recurrent_snapshot_bytes", 'engine="0",model_name="m"') == 2 * state_bytes

    no_pool = dataclasses.replace(engines[0], recurrent_snapshot_slots=0)
    assert "vllm:recurrent_snapshot" not in ServerMetrics(lambda: no_pool, "m").render().decode()
