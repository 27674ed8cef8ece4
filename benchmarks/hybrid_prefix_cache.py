"""Prefix caching on a hybrid recurrent model: what recurrent-state snapshots cost a cold prefill and save a
repeated one. On benchmarks/hybrid_decode.py's Granite-4.0-H-350M-shaped random checkpoint, one-token requests
of --prompt-len random tokens: cold prompts (a fresh first token: nothing shared) with prefix caching off and
on (snapshots taken every 64 tokens), then the same prompt again with caching on (resumed from the last
snapshot inside its cached prefix). Best of --rounds; the modes alternate run by run so a shared host's load
falls on both alike.

    python benchmarks/hybrid_prefix_cache.py [--prompt-len 1024] [--layers 8] [--rounds 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from hybrid_decode import checkpoint  # benchmarks/: run as a script
from vllmpy import LLM, SamplingParams
from vllmpy.loader.default_model import default_model_path


def timed(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Seconds of a one-token request and the prompt tokens it took from the prefix cache."""
    start = time.perf_counter()
    (output,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1),
                             use_tqdm=False)
    return time.perf_counter() - start, output.num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/vllmpy-bench"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = checkpoint(args.dir, args.layers, default_model_path())
    engines = {caching: LLM(model=str(path), dtype="float32", max_model_len=2 * args.prompt_len, max_num_seqs=4,
                            enable_prefix_caching=caching, kv_cache_memory=2 * 2**30) for caching in (False, True)}
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 40000, (args.prompt_len,), generator=gen).tolist()
    firsts = itertools.count(40001)
    cold: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for caching, llm in engines.items():
            cold[caching].append(timed(llm, [next(firsts)] + prompt[1:])[0])
    timed(engines[True], prompt)  # cached once
    warm = [timed(engines[True], prompt) for _ in range(args.rounds)]
    stats = engines[True].engine.stats()
    print(f"{args.layers} layers, {args.prompt_len}-token prompt, {args.threads} thread(s), best of {args.rounds}")
    print(f"cold prefill, caching off: {min(cold[False]):.2f} s; on (snapshots taken): {min(cold[True]):.2f} s")
    print(f"repeat, caching on: {min(t for t, _ in warm):.2f} s ({warm[-1][1]} tokens resumed); snapshot hits "
          f"{stats.recurrent_snapshot_hits}, snapshot memory {stats.recurrent_snapshot_bytes / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
