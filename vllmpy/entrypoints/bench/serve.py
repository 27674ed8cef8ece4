"""`vllm-bench serve`: C concurrent streaming clients against a running OpenAI-compatible server, requests
arriving as a Poisson process (or all at once); TTFT / TPOT / ITL / E2E percentiles, throughput, errors."""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import re
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from vllmpy.entrypoints.bench.checks import require_positive
from vllmpy.entrypoints.bench.header import INFO_METRICS, version_line
from vllmpy.entrypoints.bench.prompts import load_jsonl, random_token_prompts
from vllmpy.entrypoints.bench.report import Report, summarize

NOT_REPORTED = "not reported by the server"
_INFO_LINE = re.compile(r"^([\w:]+)\{(.*)\}\s", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_ESCAPED = re.compile(r"\\(.)")  # label values escape backslash, double quote and newline
# Text whose tokens seed random prompts: /tokenize turns it into ids the server's vocabulary surely has.
_SEED_TEXT = ("The quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches; "
              "meanwhile, 42 engineers benchmark inference servers, measuring latency, throughput and memory "
              "bandwidth across CPUs, GPUs and accelerators in Paris, Tokyo, Lagos and São Paulo.")


class ServeError(RuntimeError):
    """The server cannot be benchmarked: unreachable, no model, or every request failed."""


def add_parser(modes: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = modes.add_parser("serve", help="streaming clients against a running server",
                              description="Drive a running OpenAI-compatible server with streaming completions.")
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions", help="completions route under --base-url")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    parser.add_argument("--input-len", type=int, default=256, help="tokens per random prompt")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per request (ignore_eos)")
    parser.add_argument("--dataset-path", default=None, metavar="JSONL",
                        help='prompts from a JSONL file ({"prompt": ...} or {"prompt_token_ids": [...]})')
    parser.add_argument("--max-concurrency", type=int, default=16, help="clients with a request in flight (C)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="mean requests/s of a Poisson arrival process (default inf: all at once)")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $VLLM_API_KEY, else $OPENAI_API_KEY)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts and arrival times")
    return parser


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None


async def stream_completion(client: httpx.AsyncClient, url: str, payload: dict, prompt_tokens: int) -> RequestResult:
    """One streamed request; token counts from the usage chunk when the server sends one, else chunks."""
    result = RequestResult(prompt_tokens)
    start = time.perf_counter()
    arrivals: list[float] = []
    usage = None
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"stream error: {json.dumps(event['error'])[:200]}"
                    return result
                usage = event.get("usage") or usage
                if event.get("choices"):
                    arrivals.append(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if not arrivals:
        result.error = "the stream carried no tokens"
        return result
    result.e2e = time.perf_counter() - start
    result.ttft = arrivals[0] - start
    result.itl = [b - a for a, b in itertools.pairwise(arrivals)]
    result.output_tokens = usage["completion_tokens"] if usage else len(arrivals)
    result.prompt_tokens = usage["prompt_tokens"] if usage else prompt_tokens
    return result


async def drive(client: httpx.AsyncClient, url: str, requests: list[tuple[dict, int]], concurrency: int,
                rate: float, seed: int) -> tuple[list[RequestResult], float]:
    """Send (payload, prompt_tokens) pairs: Poisson arrivals at `rate`, at most `concurrency` in flight."""
    slots = asyncio.Semaphore(concurrency)
    gaps = random.Random(seed)

    async def limited(payload: dict, prompt_tokens: int) -> RequestResult:
        async with slots:
            return await stream_completion(client, url, payload, prompt_tokens)

    tasks = []
    start = time.perf_counter()
    with tqdm(total=len(requests), desc="Requests", unit="req", disable=None, leave=False) as bar:
        for payload, prompt_tokens in requests:
            task = asyncio.create_task(limited(payload, prompt_tokens))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
            if math.isfinite(rate):
                await asyncio.sleep(gaps.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def figures(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.error is None]
    if not ok:
        raise ServeError(f"all {len(results)} requests failed; first error: {results[0].error}")
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out = {"completed": len(ok), "errors": len(results) - len(ok), "duration_s": duration,
           "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
           "requests_per_s": len(ok) / duration, "output_tok_per_s": output_tokens / duration,
           "total_tok_per_s": (input_tokens + output_tokens) / duration}
    for name, values in (("ttft_ms", [r.ttft for r in ok]), ("tpot_ms", tpot),
                         ("itl_ms", [g for r in ok for g in r.itl]), ("e2e_ms", [r.e2e for r in ok])):
        out |= summarize(values, name, 1e3, percentiles=(50, 90, 99))
    return out


def completion_payload(model: str, prompt: str | list[int], output_len: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def server_header(client: httpx.AsyncClient, base_url: str) -> tuple[str, dict[str, str]]:
    """(first served model name, header): version and model from the standard routes, the engine's
    configuration from `*_info` metric labels where the server exports them."""
    try:
        models = (await client.get(f"{base_url}/v1/models")).raise_for_status().json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        raise ServeError(f"{base_url}/v1/models did not answer with a model list ({exc})") from None
    if not models:
        raise ServeError(f"{base_url}/v1/models lists no model")
    header = {"vllmpy version": f"{version_line()} (client)", "Server": base_url,
              "Server version": await _get_json(client, f"{base_url}/version", "version"),
              "Model": models[0].get("root") or models[0]["id"]}
    metrics = await client.get(f"{base_url}/metrics")
    return models[0]["id"], header | info_header(metrics.text if metrics.status_code == 200 else "")


def info_header(metrics: str) -> dict[str, str]:
    """The engine lines of the header from the INFO_METRICS gauges in Prometheus text; NOT_REPORTED for
    the lines a server does not export (all of them for servers without /metrics)."""
    header = {line: NOT_REPORTED for labels in INFO_METRICS.values() for line in labels.values()}
    for name, labels in _INFO_LINE.findall(metrics):
        lines = INFO_METRICS.get(name, {})
        for key, value in _LABEL.findall(labels):
            if key in lines:
                header[lines[key]] = _ESCAPED.sub(lambda m: "\n" if m[1] == "n" else m[1], value)
    return header


async def _get_json(client: httpx.AsyncClient, url: str, key: str) -> str:
    try:
        return str((await client.get(url)).raise_for_status().json()[key])
    except (httpx.HTTPError, KeyError, ValueError):
        return NOT_REPORTED


async def server_token_prompts(client: httpx.AsyncClient, base_url: str, model: str, count: int, length: int,
                               seed: int) -> list[list[int]]:
    """Random prompts of exactly `length` ids drawn from tokens the server's own /tokenize produced."""
    try:
        reply = await client.post(f"{base_url}/tokenize",
                                  json={"model": model, "prompt": _SEED_TEXT, "add_special_tokens": False})
        vocab = sorted(set(reply.raise_for_status().json()["tokens"]))
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        raise ServeError(f"random prompts need the server's /tokenize ({exc}); pass --dataset-path instead") from None
    if not vocab:  # llama.cpp's server reads `content`, and answers a `prompt` with no tokens
        raise ServeError("the server's /tokenize returned no tokens for a vLLM-style request; pass --dataset-path")
    return random_token_prompts(vocab, count, length, seed)


async def _bench(args: argparse.Namespace) -> Report:
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), headers=headers,
                                 limits=httpx.Limits(max_connections=None)) as client:
        served, header = await server_header(client, base_url)
        model = args.model or served
        if args.dataset_path:
            prompts: list = [p.get("prompt", p.get("prompt_token_ids")) for p in
                             load_jsonl(args.dataset_path, args.num_prompts)]
        else:
            prompts = await server_token_prompts(client, base_url, model, args.num_prompts, args.input_len, args.seed)
        requests = [(completion_payload(model, p, args.output_len), len(p) if isinstance(p, list) else 0)
                    for p in prompts]
        results, duration = await drive(client, base_url + args.endpoint, requests, args.max_concurrency,
                                        args.request_rate, args.seed)
    header |= {"Max concurrency": str(args.max_concurrency), "Request rate": f"{args.request_rate} req/s"}
    report = Report("serve", header, figures(results, duration))
    report.notes = sorted({r.error for r in results if r.error})[:5]
    return report


def run(args: argparse.Namespace) -> Report:
    require_positive(args, "num_prompts", "input_len", "output_len", "max_concurrency")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf = all at once), got {args.request_rate}")
    return asyncio.run(_bench(args))
