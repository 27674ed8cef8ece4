"""`vllm-bench latency`: one batch of B prompts (I tokens in, O out), repeated; TTFT, TPOT and end-to-end."""
from __future__ import annotations

import argparse
import time

from tqdm import tqdm

from vllmpy.entrypoints.bench.checks import require_positive
from vllmpy.entrypoints.bench.offline import OfflineBench
from vllmpy.entrypoints.bench.report import Report, summarize
from vllmpy.entrypoints.engine_args import add_engine_args


def add_parser(modes: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = modes.add_parser("latency", help="latency of one batch, repeated",
                              description="Latency of one batch: prefill (TTFT), decode (TPOT), end to end.")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per batch (B)")
    parser.add_argument("--input-len", type=int, default=32, help="tokens per prompt (I)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (O)")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="untimed batches first")
    parser.add_argument("--num-iters", type=int, default=5, help="timed batches")
    add_engine_args(parser)
    return parser


def run(args: argparse.Namespace) -> Report:
    require_positive(args, "batch_size", "input_len", "output_len", "num_iters")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")
    bench = OfflineBench(args)
    params = bench.params(args.output_len)
    ttft, tpot, e2e = [], [], []
    total = args.num_iters_warmup + args.num_iters
    for i in tqdm(range(total), desc="Latency batches", unit="batch", disable=None, leave=False):
        # Fresh prompts each batch: a repeated prompt would hit the prefix cache and skip its prefill.
        prompts = bench.random_prompts(args.batch_size, args.input_len, bench.seed + i)
        start = time.perf_counter()
        outputs = bench.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        if i < args.num_iters_warmup:
            continue
        e2e.append(elapsed)
        ttft += [o.metrics.ttft for o in outputs]
        tpot += [o.metrics.tpot for o in outputs if o.metrics.tpot is not None]
    results = {"batches": args.num_iters, "requests": len(ttft)}
    results |= summarize(ttft, "ttft_ms", 1e3)
    results |= summarize(tpot, "tpot_ms", 1e3)
    results |= summarize(e2e, "e2e_latency_s")
    # Batch rates at the median: B*I prompt tokens per TTFT, B tokens per TPOT.
    results["prefill_tok_per_s"] = args.batch_size * args.input_len / (results["ttft_ms_p50"] / 1e3)
    results["decode_tok_per_s"] = args.batch_size / (results["tpot_ms_p50"] / 1e3) if tpot else None
    return Report("latency", bench.header, results | bench.spec_figures())
