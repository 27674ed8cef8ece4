"""Pickled SchedulerOutput bytes of one decode step: what tensor parallel broadcasts to every worker.

16 requests decode after a 2k- or 16k-token prompt, on a one-group full-attention layout (Llama-like)
and the default model's layout (Gemma 3: a full group and a sliding-window-512 group). Run:
    python benchmarks/scheduler_output_bytes.py
"""
from __future__ import annotations

import pickle

import torch

from vllmpy.config import CacheConfig, SchedulerConfig
from vllmpy.engine.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheLayout, SlidingWindowSpec
from vllmpy.engine.request import Request
from vllmpy.engine.schedule_types import ModelRunnerOutput
from vllmpy.engine.scheduler import Scheduler
from vllmpy.sampling_params import SamplingParams

BLOCK, REQUESTS = 16, 16
LAYOUTS = {
    "full": [FullAttentionSpec(BLOCK, 1, 1, torch.float32)],
    "gemma3 (full + sliding 512)": [FullAttentionSpec(BLOCK, 1, 1, torch.float32),
                                    SlidingWindowSpec(BLOCK, 1, 1, torch.float32, 512)],
}


def decode_step_bytes(specs: list, context: int) -> tuple[int, int]:
    """(bytes of the first decode step's output, of the 8th): every prompt prefilled in the first step."""
    max_len = context + 64
    layout = KVCacheLayout.from_specs(specs, max_len)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=REQUESTS, max_num_batched_tokens=REQUESTS * max_len),
                          CacheConfig(block_size=BLOCK),
                          KVCacheConfig(len(layout.groups) * REQUESTS * (max_len // BLOCK + 2), layout), max_len)
    for i in range(REQUESTS):
        scheduler.add_request(Request(f"r{i}", [1] * context, SamplingParams(max_tokens=32)))
    sizes = []
    for step in range(9):
        out = scheduler.schedule()
        assert len(out.chunks) == REQUESTS and (step == 0) == (len(out.chunks[0].token_ids) > 1)
        sizes.append(len(pickle.dumps(out)))
        ids = [c.req_id for c in out.chunks]
        scheduler.update_from_output(out, ModelRunnerOutput(ids, [[2] for _ in ids], [None] * len(ids)))
    return sizes[1], sizes[8]


def main() -> None:
    for name, specs in LAYOUTS.items():
        for context in (2048, 16384):
            first, later = decode_step_bytes(specs, context)
            print(f"{name:28s} context {context:6d}: decode step {first:7d} B (8th step: {later} B)")


if __name__ == "__main__":
    main()
