"""The sparse MoE layer on a tiny-but-wide shape (64 experts, top-6): the per-expert loop, one grouped
matmul per projection, and what ships (grouped up to a few rows per expert on CPU), interleaved and
the best of 5 rounds because the dev host is shared.

    python benchmarks/moe_layer.py [--threads 1]
"""
from __future__ import annotations

import argparse
import time

import torch

import vllmpy.layers.moe as moe_module
from vllmpy.layers.moe import SparseMoE

MODES = {"loop": (False, 0), "grouped": (True, 1 << 30), "ships": (True, moe_module._CPU_GROUPED_ROWS_PER_EXPERT)}


def timed(moe: SparseMoE, x: torch.Tensor, mode: str, iters: int) -> float:
    moe_module._GROUPED_MM, moe_module._CPU_GROUPED_ROWS_PER_EXPERT = MODES[mode]
    moe(x)
    start = time.perf_counter()
    for _ in range(iters):
        moe(x)
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(f"hidden {args.hidden}, expert intermediate {args.intermediate}, 64 experts top-6, "
          f"{args.threads} thread(s): ms per layer forward")
    for dtype in (torch.float32, torch.bfloat16):
        moe = SparseMoE(args.hidden, args.intermediate, 64, 6, "silu", renormalize=True).to(dtype)
        for p in moe.parameters():
            p.data.normal_(0, 0.05)
        for tokens in (1, 16, 512):
            x = torch.randn(tokens, args.hidden, dtype=dtype)
            best = dict.fromkeys(MODES, float("inf"))
            with torch.inference_mode():
                for _ in range(5):
                    for mode in MODES:
                        best[mode] = min(best[mode], timed(moe, x, mode, 40 if tokens < 100 else 3))
            cells = "  ".join(f"{mode} {seconds * 1e3:7.3f}" for mode, seconds in best.items())
            print(f"{str(dtype)[6:]:9s} tokens {tokens:4d}  {cells}")


if __name__ == "__main__":
    main()
