"""`vllm-bench throughput`: N prompts submitted at once, fixed output length; requests/s and tokens/s."""
from __future__ import annotations

import argparse
import time

from vllmpy.entrypoints.bench.checks import require_positive
from vllmpy.entrypoints.bench.offline import OfflineBench
from vllmpy.entrypoints.bench.prompts import load_jsonl
from vllmpy.entrypoints.bench.report import Report
from vllmpy.entrypoints.engine_args import add_engine_args


def add_parser(modes: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = modes.add_parser("throughput", help="offline throughput of N prompts",
                              description="Offline throughput: N prompts at once, greedy, ignore_eos.")
    parser.add_argument("--num-prompts", type=int, default=64, help="prompts to run")
    parser.add_argument("--input-len", type=int, default=256, help="tokens per random prompt")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--dataset-path", default=None, metavar="JSONL",
                        help='prompts from a JSONL file ({"prompt": ...} or {"prompt_token_ids": [...]} per '
                             'line) instead of random token ids; the first --num-prompts lines are used')
    add_engine_args(parser)
    return parser


def run(args: argparse.Namespace) -> Report:
    require_positive(args, "num_prompts", "input_len", "output_len")
    bench = OfflineBench(args)
    prompts = (load_jsonl(args.dataset_path, args.num_prompts) if args.dataset_path
               else bench.random_prompts(args.num_prompts, args.input_len, bench.seed))
    params = bench.params(args.output_len)
    bench.warm_up(bench.seed + 1)
    start = time.perf_counter()
    outputs = bench.llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    input_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    results = {
        "num_requests": len(outputs),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "input_tok_per_s": input_tokens / elapsed,
        "output_tok_per_s": output_tokens / elapsed,
        "total_tok_per_s": (input_tokens + output_tokens) / elapsed,
    } | bench.spec_figures()
    return Report("throughput", bench.header, results)
