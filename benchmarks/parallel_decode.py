"""Prefill and decode tok/s of one parallel layout:
`python benchmarks/parallel_decode.py TP PP [--llama-1b] [--allreduce auto|shm|gloo]` (TP=PP=1 runs one
process with 2 torch threads; otherwise one thread per rank). The default model, or with --llama-1b a
random Llama-3.2-1B-shaped checkpoint (hidden 2048, 16 layers, 32 / 8 heads, FFN 8192, SmolLM2's 49k
tokenizer, tied; ~1.07B parameters, built once under /tmp/vllmpy-bench) in --dtype. Prefill:
--prefill-prompts prompts of 256 tokens, one token each. Decode: 32 steps at batch 1 and 8 (the
33-token run minus the 1-token run), so prefill time drops out. Under TP the driver's time inside the
all-reduces (waiting for the other ranks included) is printed per decode step. Alternate the layouts in
a shell loop for ratios on a shared host.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from vllmpy import LLM, SamplingParams


def _seconds(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


class AllReduceTimer:
    """Seconds and calls the driver spends in TPGroup.all_reduce while `on` (class-level wrap: the layers'
    hooks call it through the group instance)."""

    def __init__(self) -> None:
        from vllmpy.distributed.parallel_state import TPGroup

        self.seconds, self.calls, self.on = 0.0, 0, False
        inner = TPGroup.all_reduce

        def timed(group, x: torch.Tensor) -> torch.Tensor:
            if not self.on:
                return inner(group, x)
            start = time.perf_counter()
            out = inner(group, x)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return out

        TPGroup.all_reduce = timed


def llama_1b() -> str:
    """The random 1B-class checkpoint (saved once; float32 on disk, cast at load)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.*: the tokenizer and saver
    from transformers import LlamaConfig

    from tests.conftest import _hf_tokenizer_dir, smollm2_gguf
    from tests.tiny_models import make_tiny_checkpoint

    out = Path("/tmp/vllmpy-bench/llama-1b")
    if not (out / "config.json").exists():
        tokenizer = _hf_tokenizer_dir(smollm2_gguf(), out.parent / "smollm2-tokenizer")
        make_tiny_checkpoint("LlamaForCausalLM", tokenizer, out, make_config=lambda vocab: LlamaConfig(
            vocab_size=vocab, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=1024, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=True))
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tp", type=int)
    parser.add_argument("pp", type=int)
    parser.add_argument("--llama-1b", action="store_true")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--allreduce", choices=["auto", "shm", "gloo"], default="auto",
                        help="VLLMPY_TP_ALLREDUCE for the ranks")
    parser.add_argument("--prefill-prompts", type=int, default=4)
    args = parser.parse_args()
    os.environ["VLLMPY_TP_ALLREDUCE"] = args.allreduce  # the spawned workers inherit it
    if args.tp * args.pp == 1:
        torch.set_num_threads(2)
    model = {"model": llama_1b()} if args.llama_1b else {}
    llm = LLM(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, max_model_len=512, dtype=args.dtype,
              **model)
    timer = AllReduceTimer()
    _seconds(llm, [[100 + i] * 8 for i in range(2)], 4)  # warm-up
    long = [[(7 * i + j) % 5000 + 100 for j in range(256)] for i in range(args.prefill_prompts)]
    rates = {"prefill": args.prefill_prompts * 256 / _seconds(llm, long, 1)}
    per_step = {}
    for batch in (1, 8):
        prompts = [[(13 * i + j) % 5000 + 100 for j in range(16)] for i in range(batch)]
        one = _seconds(llm, prompts, 1)
        timer.on, timer.seconds, timer.calls = True, 0.0, 0
        rates[f"decode batch {batch}"] = batch * 32 / (_seconds(llm, prompts, 33) - one)
        timer.on = False
        per_step[batch] = (timer.seconds * 1e3 / 33, timer.calls / 33)
    executor = llm.engine.core.executor
    allreduce = "".join(f", all-reduce b={b} {ms:.1f} ms/step ({n:.0f} calls)" for b, (ms, n) in per_step.items()
                        if n) if args.tp > 1 else ""
    group = getattr(executor, "group", None)
    links = ("shm" if getattr(group, "shm", None) else "gloo") if group is not None else "one process"
    print(f"tp={args.tp} pp={args.pp} {links} "
          f"threads/rank={torch.get_num_threads()}", ", ".join(f"{name} {rate:.1f} tok/s" for name, rate in rates.items()),
          f"max micro-batches in flight {getattr(executor, 'max_in_flight', 1)}{allreduce}", flush=True)
    llm.engine.core.shutdown()


if __name__ == "__main__":
    main()
