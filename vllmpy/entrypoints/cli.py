"""vllm-cli: one prompt, N completions; text on stdout, timing lines on stderr (the seed's format).

The engine's modules (torch first) are imported once a GGUF model's cached tokenizer has started loading
on a thread (`gguf_cache.prefetch`): on a warm start the two overlap, and the main thread's CPU time falls
by the parse (3.0-3.1 -> 2.0-2.1 s on the default model, measured on a 2-core host at load 15).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def _prefetch_tokenizer(argv: list[str]) -> None:
    """The default model's or a --model .gguf file's cached tokenizer starts loading now (any other --model,
    or an argument the full parser refuses, starts nothing: the engine loads its tokenizer itself)."""
    from vllmpy.loader.default_model import assembled_default_model_path
    from vllmpy.tokenizer.gguf_cache import prefetch

    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    early.add_argument("--model", default=None)
    try:
        model = early.parse_known_args(argv)[0].model
    except argparse.ArgumentError:
        return
    path = assembled_default_model_path() if model is None else model
    if path is not None and path.endswith(".gguf") and os.path.isfile(path):
        prefetch(path)


def build_parser() -> argparse.ArgumentParser:
    from vllmpy.entrypoints.engine_args import add_engine_args

    parser = argparse.ArgumentParser(prog="vllm-cli", description="Run completions on a local model.")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=None,
                        help="0 = greedy (default: the model's generation_config, else 1.0)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--repeat", type=int, default=1, help="load once, run N completions")
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from vllmpy.loader.heap import one_malloc_arena

    one_malloc_arena()  # before any thread starts
    _prefetch_tokenizer(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    if args.repeat < 1:
        print("vllm-cli: --repeat must be >= 1", file=sys.stderr)
        return 2
    from vllmpy.entrypoints.engine_args import engine_config_from_args
    from vllmpy.entrypoints.llm import LLM
    from vllmpy.errors import UnsupportedCheckpointError

    try:
        llm = LLM(engine_config=engine_config_from_args(args))
        task = llm.engine.core.task
        if task != "generate":
            kind = "an embedding" if task == "embed" else "a classification"
            raise ValueError(f"the model is {kind} model (task {task}) and vllm-cli generates text; use "
                             f"LLM.embed() / .classify() / .score() or vllm-server's /v1/embeddings, /classify, /score")
        overrides = {k: v for k, v in {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                                        "min_p": args.min_p, "seed": args.seed}.items() if v is not None}
        params = llm.get_default_sampling_params().clone(
            max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos, **overrides)
    except (ValueError, FileNotFoundError, UnsupportedCheckpointError) as exc:
        print(f"vllm-cli: error: {exc}", file=sys.stderr)
        return 2
    for run in range(1, args.repeat + 1):
        start = time.time()
        t0 = time.perf_counter()
        output = llm.generate([args.prompt], params, use_tqdm=False)[0]
        secs = time.perf_counter() - t0
        end = time.time()
        completion = output.outputs[0]
        print(completion.text, flush=True)
        n = len(completion.token_ids)
        tag = f"vllm-cli: run={run}/{args.repeat}"
        print(f"{tag} finish_reason={completion.finish_reason} prompt_tokens={len(output.prompt_token_ids)} "
              f"completion_tokens={n} secs={secs:.3f} tok_s={n / secs if secs > 0 else 0.0:.3f}", file=sys.stderr)
        print(f"{tag} generate_start_unix={start:.6f} generate_end_unix={end:.6f}", file=sys.stderr, flush=True)
    return 0


def run() -> None:
    """The `vllm-cli` command: main(), then exit without interpreter teardown (`process_exit`); main()
    itself returns, for callers in the same process."""
    from vllmpy.entrypoints.process_exit import exit_process

    exit_process(main())


if __name__ == "__main__":
    run()
