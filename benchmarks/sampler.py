"""Sampler cost per step on a 262k vocabulary: greedy, temperature, seeded, min_p, top_k, top_p, at several
batch sizes. `--against FILE` times another version of vllmpy/sampling/sampler.py in the same process,
interleaved round by round (e.g. `git show 2c3f4bb:vllmpy/sampling/sampler.py > /tmp/old_sampler.py`),
and prints the per-round ratio's median and range.

    python benchmarks/sampler.py [--batches 1 16 64] [--threads 1] [--rounds 15] [--against FILE]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import torch

from vllmpy.sampling import RowState, Sampler, SamplingMetadata
from vllmpy.sampling_params import SamplingParams

VOCAB = 262_144  # Gemma 3's
CASES = {"greedy": {"temperature": 0.0}, "temperature": {}, "seeded": {"seed": 1}, "min_p 0.05": {"min_p": 0.05},
         "top_k 50": {"top_k": 50}, "top_p 0.9": {"top_p": 0.9}, "top_k 50 + top_p 0.9": {"top_k": 50, "top_p": 0.9}}


def _load_sampler(path: str) -> type:
    spec = importlib.util.spec_from_file_location("other_sampler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["other_sampler"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.Sampler


def _rows(batch: int, params: dict) -> list[RowState]:
    return [RowState(params=SamplingParams(**params), prompt_token_ids=[], output_token_ids=[],
                     generator=torch.Generator().manual_seed(i) if "seed" in params else None, eos_token_ids={0})
            for i in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--against", default=None, help="another sampler.py, timed interleaved")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    samplers = {"this": Sampler()}
    if args.against:
        samplers["other"] = _load_sampler(args.against)()
    print(f"| batch | case | {' | '.join(f'{name} ms' for name in samplers)} |"
          + (" other / this (median, range) |" if args.against else ""))
    print("|---" * (2 + len(samplers) + bool(args.against)) + "|")
    for batch in args.batches:
        logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * 4
        for case, params in CASES.items():
            meta = SamplingMetadata.build(_rows(batch, params), VOCAB, torch.device("cpu"))
            times: dict[str, list[float]] = {name: [] for name in samplers}
            for sampler in samplers.values():
                sampler(logits, meta)
            for _ in range(args.rounds):
                for name, sampler in samplers.items():
                    start = time.perf_counter()
                    sampler(logits, meta)
                    times[name].append(time.perf_counter() - start)
            cells = " | ".join(f"{statistics.median(t) * 1e3:.3f}" for t in times.values())
            line = f"| {batch} | {case} | {cells} |"
            if args.against:
                ratios = sorted(o / t for o, t in zip(times["other"], times["this"]))
                line += f" {statistics.median(ratios):.1f}x ({ratios[0]:.1f}-{ratios[-1]:.1f}) |"
            print(line, flush=True)


if __name__ == "__main__":
    main()
