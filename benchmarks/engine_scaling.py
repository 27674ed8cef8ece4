"""Engine scaling on one machine: output tok/s at several batch sizes, and TTFT with a cold vs warm
prefix cache. Progress on stderr, results (a markdown table) on stdout.

    python benchmarks/engine_scaling.py [--model PATH] [--batches 1 4 16 64] [--input-len 128] [--output-len 128]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peer_engines

from vllmpy import LLM, SamplingParams
from vllmpy.entrypoints.bench.prompts import random_token_prompts, usable_token_ids

# The batch sizes and lengths of the scaling measurement (here and workload (g) of benchmarks/peers.py).
BATCHES = (1, 4, 16, 64)
INPUT_LEN = OUTPUT_LEN = 128

# generate(prompts, max_tokens) -> (seconds, output tokens), as peer_engines.Engine.generate.
Generate = Callable[[list[list[int]], int], tuple[float, int]]


def random_prompts(llm: LLM, count: int, length: int, seed: int) -> list[list[int]]:
    vocab = usable_token_ids(llm.get_tokenizer(), llm.engine.core.vocab_size)
    return random_token_prompts(vocab, count, length, seed)


def output_throughput(generate: Generate, prompts: list[list[int]], output_len: int) -> float:
    """Output tok/s of one batch: every prompt at once, `output_len` tokens each, EOS ignored."""
    seconds, produced = generate(prompts, output_len)
    if produced != len(prompts) * output_len:
        raise RuntimeError(f"produced {produced} tokens, expected {len(prompts) * output_len}")
    return produced / seconds


def prefix_ttft(llm: LLM, prefix_len: int, repeats: int) -> tuple[float, float]:
    """Median seconds to the first token for a fresh prefix (cold) and for the same prefix again (warm)."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    cold, warm = [], []
    for r in range(repeats):
        prefix = random_prompts(llm, 1, prefix_len, seed=1000 + r)[0]
        for bucket, suffix in ((cold, [11, 12, 13]), (warm, [21, 22, 23])):
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prefix + suffix}], params, use_tqdm=False)
            bucket.append(time.perf_counter() - start)
    return statistics.median(cold), statistics.median(warm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--input-len", type=int, default=INPUT_LEN)
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from vllmpy.loader.default_model import default_model_path

    engine = peer_engines.VllmpyEngine(args.model or default_model_path(), 2048, max(args.batches))
    llm = engine.llm
    print(f"| batch | output tok/s | vs batch {args.batches[0]} |\n|---|---|---|")
    base = None
    for batch in args.batches:
        tps = output_throughput(engine.generate, random_prompts(llm, batch, args.input_len, seed=batch),
                                args.output_len)
        base = base or tps
        print(f"| {batch} | {tps:.1f} | {tps / base:.2f}x |", flush=True)
    cold, warm = prefix_ttft(llm, args.prefix_len, args.repeats)
    print(f"\nTTFT, {args.prefix_len}-token shared prefix: cold {cold * 1000:.0f} ms, warm {warm * 1000:.0f} ms "
          f"({cold / warm:.1f}x)")
    print(f"prefix cache: {llm.engine.stats()}", file=sys.stderr)


if __name__ == "__main__":
    main()
