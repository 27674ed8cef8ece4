"""Engine scaling on one machine: output tok/s at several batch sizes, and TTFT with a cold vs warm
prefix cache. Progress on stderr, results (a markdown table) on stdout.

    python benchmarks/engine_scaling.py [--model PATH] [--batches 1 4 16 64] [--input-len 128] [--output-len 128]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from vllmpy import LLM, SamplingParams
from vllmpy.entrypoints.bench.prompts import random_token_prompts, usable_token_ids


def random_prompts(llm: LLM, count: int, length: int, seed: int) -> list[dict]:
    vocab = usable_token_ids(llm.get_tokenizer(), llm.engine.core.vocab_size)
    return [{"prompt_token_ids": ids} for ids in random_token_prompts(vocab, count, length, seed)]


def output_throughput(llm: LLM, batch: int, input_len: int, output_len: int) -> float:
    prompts = random_prompts(llm, batch, input_len, seed=batch)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def prefix_ttft(llm: LLM, prefix_len: int, repeats: int) -> tuple[float, float]:
    """Median seconds to the first token for a fresh prefix (cold) and for the same prefix again (warm)."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    cold, warm = [], []
    for r in range(repeats):
        prefix = random_prompts(llm, 1, prefix_len, seed=1000 + r)[0]["prompt_token_ids"]
        for bucket, suffix in ((cold, [11, 12, 13]), (warm, [21, 22, 23])):
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prefix + suffix}], params, use_tqdm=False)
            bucket.append(time.perf_counter() - start)
    return statistics.median(cold), statistics.median(warm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=2048, max_num_seqs=max(args.batches))
    print(f"| batch | output tok/s | vs batch {args.batches[0]} |\n|---|---|---|")
    base = None
    for batch in args.batches:
        tps = output_throughput(llm, batch, args.input_len, args.output_len)
        base = base or tps
        print(f"| {batch} | {tps:.1f} | {tps / base:.2f}x |", flush=True)
    cold, warm = prefix_ttft(llm, args.prefix_len, args.repeats)
    print(f"\nTTFT, {args.prefix_len}-token shared prefix: cold {cold * 1000:.0f} ms, warm {warm * 1000:.0f} ms "
          f"({cold / warm:.1f}x)")
    print(f"prefix cache: {llm.engine.stats()}", file=sys.stderr)


if __name__ == "__main__":
    main()
