"""vllm-bench: `throughput` (offline batch), `latency` (one batch, repeated) and `serve` (HTTP clients
against a running server). Progress bars go to stderr, the report to stdout, `--output-json` to a file."""
from __future__ import annotations

import argparse
import logging
import math
import sys

from vllmpy.entrypoints.bench import latency, serve, throughput


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-bench", description="Benchmark vllmpy offline or over HTTP.")
    modes = parser.add_subparsers(dest="mode", required=True, metavar="{throughput,latency,serve}")
    for mode in (throughput, latency, serve):
        sub = mode.add_parser(modes)
        sub.add_argument("--output-json", default=None, metavar="FILE", help="also write every figure to FILE")
        sub.set_defaults(run=mode.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    from vllmpy.errors import UnsupportedCheckpointError

    try:
        report = args.run(args)
    except (ValueError, OSError, UnsupportedCheckpointError, serve.ServeError) as exc:
        print(f"vllm-bench: error: {exc}", file=sys.stderr)
        return 2
    report.args = _json_args(args)
    print(report.render(), flush=True)
    if args.output_json:
        report.write_json(args.output_json)
    return 0


def _json_args(args: argparse.Namespace) -> dict:
    """The flags as JSON allows them: no callables, no secrets, infinities as strings."""
    out = {}
    for key, value in vars(args).items():
        if key in ("run", "api_key"):
            continue
        out[key] = str(value) if isinstance(value, float) and not math.isfinite(value) else value
    return out
