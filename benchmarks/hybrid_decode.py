"""A Granite-4.0-H-350M-shaped hybrid with random weights (768 hidden, 28 Mamba2 layers of 48 heads x 32 x d_state
128, n_groups 1, + 4 attention layers of 12 query / 4 KV heads x 64, dense 2048 MLP, 100,352 vocabulary, tied
embeddings; the attention layers evenly placed, which does not change a step's cost): first one Mamba2 layer's
decode step alone on both paths (ms), then decode tok/s at each batch
and prefill tok/s of one prompt, with the recurrent C kernels (vllmpy/kernels/recurrent_ops.c) and with the
torch ops they replace, vs transformers' generate (use_cache) on the same weights; then the state bytes per
sequence vs the KV an all-attention model of the same shape holds. --breakdown splits the decode step of each
path: the recurrent mixers' time without their projections and norm (the conv + SSM updates and their
gathers), and torch.profiler's top ops.

Decode tok/s = batch x N / the time from the first generated token to the 1 + N-th (prefill not counted),
prefill tok/s = prompt tokens / the time of a one-token request; best of --rounds.

    python benchmarks/hybrid_decode.py [--dtypes float32 bfloat16] [--batches 1 16] [--decode-tokens 16]
        [--prompt-len 256] [--layers 32] [--threads 1] [--rounds 3] [--no-transformers] [--breakdown]
"""
from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vllmpy import LLM, SamplingParams
from vllmpy.layers import recurrent_kernels
from vllmpy.layers.mamba2 import Mamba2Mixer
from vllmpy.layers.recurrent_state import RecurrentMetadata, RecurrentStateSpec
from vllmpy.loader.default_model import default_model_path

VOCAB, KV_HEADS = 100352, 4
KERNELS = recurrent_kernels.recurrent_kernels


def checkpoint(out: Path, layers: int, tokenizer: str) -> Path:
    """Save the random hybrid (1 attention layer in 8) with the tokenizer's files, once per layer count."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GraniteMoeHybridConfig

    out = out / f"granite-h-350m-like-{layers}"
    if (out / "config.json").exists():
        return out
    types = ["full_attention" if i % 8 == 7 else "linear_attention" for i in range(layers)]
    config = GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=768, intermediate_size=2048, shared_intermediate_size=2048,
        num_local_experts=0, num_hidden_layers=layers, layer_types=types, num_attention_heads=12,
        num_key_value_heads=KV_HEADS, mamba_n_heads=48, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=128,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, position_embedding_type="nope",
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        architectures=["GraniteMoeHybridForCausalLM"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(Path(tokenizer).parent, gguf_file=Path(tokenizer).name).save_pretrained(out)
    return out


def best(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 40000, (batch, length), generator=gen).tolist()  # fresh ids: no prefix-cache hit


def engine_rates(llm: LLM, paths: dict[str, Callable], batches: list[int], n: int, prompt_len: int,
                 rounds: int) -> dict[str, list[float]]:
    """Per path (a recurrent_kernels accessor): [decode tok/s per batch..., prefill tok/s], decode timed from each
    request's first to last token; the paths alternate run by run so the host's load falls on both alike."""
    seeds = itertools.count(1)

    def run(batch: int, tokens: int, length: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts(batch, length, next(seeds))], params,
                            use_tqdm=False)
        if tokens == 1:
            return time.perf_counter() - start
        return max(o.metrics.last_token_time for o in outs) - min(o.metrics.first_token_time for o in outs)

    cases = [(batch, 1 + n, 8, batch * n) for batch in batches] + [(1, 1, prompt_len, prompt_len)]
    rates: dict[str, list[float]] = {label: [] for label in paths}
    for batch, tokens, length, work in cases:
        times: dict[str, list[float]] = {label: [] for label in paths}
        for _ in range(rounds):
            for label, lib in paths.items():
                recurrent_kernels.recurrent_kernels = lib
                times[label].append(run(batch, tokens, length))
        for label in paths:
            rates[label].append(work / min(times[label]))
    recurrent_kernels.recurrent_kernels = KERNELS
    return rates


def mixer_step(batches: list[int], dtype: torch.dtype, reps: int) -> None:
    """One Granite-shaped Mamba2 layer's decode step alone (ms, best of `reps`, paths interleaved): the whole
    mixer, and its conv + SSM update (the mixer minus in_proj, the gated norm and out_proj)."""
    mixer = Mamba2Mixer(768, 48, 32, 1, 128, 4, 256, 1e-5)
    for p in mixer.parameters():
        p.data = (torch.randn(p.shape) * 0.05).to(dtype)
    mixer.to(dtype)
    spec = mixer.recurrent_state_spec(torch.float32)
    for batch in batches:
        state = [torch.randn(batch, *shape).to(d) for shape, d in zip(spec.shapes, spec.dtypes)]
        meta = RecurrentMetadata.build(list(range(batch))[::-1], [9] * batch, [1] * batch, torch.device("cpu"))
        hidden = torch.randn(batch, 768).to(dtype)
        projected = mixer.project(hidden)
        gate = projected[:, :mixer.intermediate]
        y = torch.randn(batch, mixer.intermediate, dtype=torch.float32)

        def dense() -> None:
            mixer.project(hidden)
            mixer.out_proj(mixer.norm(y, gate).to(dtype))
        times: dict[str, list[float]] = {"C kernels": [], "torch ops": [], "projections + norm": []}
        with torch.no_grad():
            for _ in range(reps):
                for label, lib in (("C kernels", KERNELS), ("torch ops", lambda: None)):
                    recurrent_kernels.recurrent_kernels = lib
                    times[label].append(best(lambda: mixer(hidden, state, meta), 1))
                times["projections + norm"].append(best(dense, 1))
        recurrent_kernels.recurrent_kernels = KERNELS
        ms = {label: 1e3 * min(t) for label, t in times.items()}
        dense_ms = ms.pop("projections + norm")
        print(f"  {str(dtype)[6:]} batch {batch}: " + ", ".join(
            f"{label} {t:.2f} ms (update {t - dense_ms:.2f})" for label, t in ms.items())
            + f"; projections + norm {dense_ms:.2f} ms")


def transformers_rates(path: Path, dtype: torch.dtype, batches: list[int], n: int, prompt_len: int,
                       rounds: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    def run(batch: int, tokens: int, length: int) -> float:
        """Seconds from the first token's logits to the last's (a logits processor stamps each step)."""
        ids, stamps = torch.tensor(prompts(batch, length, 0)), []
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                           do_sample=False, use_cache=True, pad_token_id=0,
                           logits_processor=[lambda _, scores: stamps.append(time.perf_counter()) or scores])
        return stamps[-1] - stamps[0]

    rates = [batch * n / min(run(batch, 1 + n, 8) for _ in range(rounds)) for batch in batches]
    return rates + [prompt_len / best(lambda: run(1, 1, prompt_len), rounds)]


def breakdown(llm: LLM, batch: int, n: int) -> None:
    """Per decode-only step: ms in the Mamba2 mixers and in their projections and norm (the rest is the conv + SSM
    update with its gathers); then torch.profiler's top ops over the whole request (its prefill included)."""
    spent = {"mixer": 0.0, "proj+norm": 0.0, "calls": 0}
    decoding = [False]
    mixers = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, Mamba2Mixer)]
    originals = []

    def timer(inner: Callable, key: str) -> Callable:
        def timed(*args, **kwargs):
            if key == "mixer":
                decoding[0] = not args[2].prefill_rows
                spent["calls"] += decoding[0]
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if decoding[0]:
                    spent[key] += time.perf_counter() - start
        return timed

    for mixer in mixers:
        for target, key in ((mixer, "mixer"), (mixer.in_proj, "proj+norm"), (mixer.out_proj, "proj+norm"),
                            (mixer.norm, "proj+norm")):
            originals.append((target, target.forward))
            target.forward = timer(target.forward, key)
    params = SamplingParams(temperature=0.0, max_tokens=1 + n, ignore_eos=True)
    start = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate([{"prompt_token_ids": ids} for ids in prompts(batch, 8, 99)], params, use_tqdm=False)
    wall = (time.perf_counter() - start) * 1e3 / (n + 1)
    for target, inner in originals:
        target.forward = inner
    steps = max(spent["calls"] / len(mixers), 1)
    mixer, proj = (spent[key] * 1e3 / steps for key in ("mixer", "proj+norm"))
    print(f"  batch {batch}: ~{wall:.1f} ms per step (profiled); per decode step the Mamba2 mixers {mixer:.1f} ms, "
          f"their projections + norm {proj:.1f} ms, conv + SSM updates with their gathers {mixer - proj:.1f} ms")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def state_bytes(llm: LLM) -> None:
    """State + attention KV per sequence (bf16 model and KV; SSM state float32, the default, and bf16) vs the KV
    of as many attention layers as the model has layers."""
    model, mib = llm.engine.core.runner.model, 2 ** 20
    for ssm_dtype in (torch.float32, torch.bfloat16):
        specs = model.kv_cache_specs(16, torch.bfloat16, ssm_dtype)
        state = sum(s.bytes_per_seq for s in specs if isinstance(s, RecurrentStateSpec))
        layer_kv = [s.page_bytes // 16 for s in specs if not isinstance(s, RecurrentStateSpec)]
        per_token, every = sum(layer_kv), len(specs) * layer_kv[0]
        for tokens in (8192, 32768):
            hybrid = state + per_token * tokens
            print(f"  SSM {str(ssm_dtype)[6:]}, {tokens} tokens: {state / mib:.1f} MiB state + "
                  f"{per_token * tokens / mib:.0f} MiB KV ({per_token} B/token) = {hybrid / mib:.1f} MiB vs "
                  f"{every * tokens / mib:.0f} MiB for {len(specs)} attention layers ({every * tokens / hybrid:.1f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a loaded shared host's OpenMP "
                        "barriers would otherwise measure the load)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/vllmpy-bench"))
    parser.add_argument("--tokenizer", default=None,
                        help="a GGUF whose tokenizer to save (default: the default model's)")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--breakdown", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.tokenizer is None:  # Gemma 3's 262k vocabulary: every id the random model emits detokenizes
        args.tokenizer = default_model_path()
    path = checkpoint(args.dir, args.layers, args.tokenizer)
    header = [f"decode b={b}" for b in args.batches] + [f"prefill {args.prompt_len}"]
    print("one Mamba2 layer's decode step:")
    for dtype in args.dtypes:
        mixer_step(args.batches, getattr(torch, dtype), 5 * args.rounds)
    rows = []
    for dtype in args.dtypes:
        llm = LLM(model=str(path), dtype=dtype, max_model_len=1024, max_num_seqs=max(args.batches),
                  max_num_batched_tokens=1024)
        paths = {"vllmpy, C kernels": KERNELS, "vllmpy, torch ops": lambda: None}
        for label, rates in engine_rates(llm, paths, args.batches, args.decode_tokens, args.prompt_len,
                                         args.rounds).items():
            rows.append((dtype, label, rates))
            print(dtype, label, rates, flush=True)
        if args.breakdown:
            for label, lib in paths.items():
                recurrent_kernels.recurrent_kernels = lib
                print(label)
                for batch in args.batches:
                    breakdown(llm, batch, args.decode_tokens)
            recurrent_kernels.recurrent_kernels = KERNELS
        print(f"state per sequence ({dtype} model: its conv windows in {dtype}):")
        state_bytes(llm)
        del llm
        if not args.no_transformers:
            rows.append((dtype, "transformers", transformers_rates(path, getattr(torch, dtype), args.batches,
                                                                   args.decode_tokens, args.prompt_len,
                                                                   args.rounds)))
            print(dtype, *rows[-1][1:], flush=True)
    print(f"\n{args.layers} layers, {args.threads} threads, tok/s")
    print("| dtype | engine | " + " | ".join(header) + " |")
    print("|---|---|" + "---|" * len(header))
    for dtype, label, rates in rows:
        print(f"| {dtype} | {label} | " + " | ".join(f"{r:.1f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
