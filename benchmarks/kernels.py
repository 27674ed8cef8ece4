"""Microbenchmark of the packed-block matmul kernels on the default model's real weights: for each
activation row count, each kernel that takes it (vq_matmul: integer row dots; vq_matmul_small: int16
panels over weight rows; vq_matmul_tiled: float tiles over activation rows) timed in interleaved rounds
(A, B, C, A, B, C, ...) so load on a shared machine hits every kernel alike; medians and spread of the
per-round ratio to the small-batch kernel.

    taskset -c 1 python benchmarks/kernels.py --threads 1 --rows 2 4 8 16 32 --reps 30

--engine: the same question end to end, on the default model in one process: (A) at batch 16 the dispatch
toggles every decode step between the former one (small-batch kernel off) and the current one, ratio of
adjacent steps; (B) batch-1 and batch-16 decode runs alternate (prefix-cached 128-token prompts), per pair
16 x t1 / t16 (batch-16 decode tok/s over batch-1) for each dispatch. With VLLMPY_PROFILE=1 the decode steps'
phase breakdown per (dispatch, batch) follows. `--toggle amx`: the former dispatch is the small-batch kernel's
VNNI panels, the current its AMX tiles (where the CPU has them).

    OMP_NUM_THREADS=1 VLLMPY_PROFILE=1 taskset -c 1 python benchmarks/kernels.py --engine --pairs 20 --reps 12

--sweep: batch-1 vq_matmul as a decode step reads the weights: all 18 layers' tensors in model order, then
the whole tied head, against one layer's tensors repeated as often (in cache: what a one-tensor loop times),
ms and GB/s per pass; with --against OLD.so (an earlier build of ggml_blocks.c) the two libraries alternate
per round and the per-round ratio old / current is printed. At --threads 1 the times are the thread's CPU
time, which load from other processes barely moves.

    python benchmarks/kernels.py --sweep --threads 1 --reps 8 --against /tmp/old-ggml_blocks.so

--against OLD.so without --sweep: the few-row kernel (vq_matmul) on each of TENSORS for each --rows count, the
two libraries alternating per round (in cache: each call repeated 20 times a round), µs per call and the
per-round ratio old / current.

    taskset -c 1 python benchmarks/kernels.py --threads 1 --rows 1 2 3 --reps 15 --against /tmp/old-ggml_blocks.so

--current NEW.so: that build as "current" instead of this CPU's cached one (with --against: two builds of another
ISA, e.g. both compiled with -march=native -mno-avx512f for an AVX2 CPU's row dots).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import vllmpy.layers.quantized as quantized
from vllmpy import profiling
from vllmpy.kernels import block_kernels
from vllmpy.loader.default_model import default_model_path
from vllmpy.loader.gguf.file import read_gguf
from vllmpy.loader.gguf.quant import hf_shape

# One layer's weights and the tied head: every block type the default model computes on.
TENSORS = ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "blk.0.attn_output.weight",
           "blk.0.attn_v.weight", "token_embd.weight")
KERNELS = ("vq_matmul", "vq_matmul_small", "vq_matmul_tiled")


def _weights(head_rows: int) -> list[tuple[str, int, torch.Tensor, tuple[int, int]]]:
    """(name, ggml type, packed bytes, [rows, cols]) of TENSORS; the head cut to head_rows rows."""
    _, tensors = read_gguf(default_model_path())
    out = []
    for tensor in tensors:
        if tensor.name in TENSORS:
            rows, cols = hf_shape(tensor)
            data = torch.from_numpy(tensor.data.view("uint8").reshape(rows, -1).copy())
            if tensor.name == "token_embd.weight":
                rows, data = head_rows, data[:head_rows].contiguous()
            out.append((tensor.name, int(tensor.tensor_type), data, (rows, cols)))
    return out


def _time(kernel: str, ggml_type: int, data: torch.Tensor, shape: tuple[int, int], x: torch.Tensor,
          threads: int) -> float | None:
    """Seconds of one call, or None where the kernel declines these rows / this build."""
    y = torch.empty(x.shape[0], shape[0])
    call = getattr(block_kernels(), kernel)
    start = time.perf_counter()
    done = call(ggml_type, data.data_ptr(), data.shape[1], shape[0], shape[1], x.data_ptr(), x.shape[0],
                y.data_ptr(), shape[0], threads)
    elapsed = time.perf_counter() - start
    return None if done == 0 else elapsed


def _use_small_kernel(on: bool) -> None:
    """The current dispatch (small-batch kernel from 4 rows), or the former one (never)."""
    quantized.SMALL_MIN_ROWS = 4 if on else quantized.SMALL_MAX_ROWS + 1


def _use_amx(on: bool) -> None:
    """The small-batch kernel with its AMX tiles where the CPU has them (current), or its VNNI panels (former)."""
    block_kernels().vq_matmul_small_amx(int(on))


# --engine --toggle: which change (A) and (B) measure, former vs current.
TOGGLES = {"small": _use_small_kernel, "amx": _use_amx}


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f}x (min {min(values):.2f}, max {max(values):.2f}, {len(values)})"


def engine_ab(pairs: int, reps: int, use: Callable[[bool], None] = _use_small_kernel) -> None:
    """(A) and (B) of the module docstring; `use(on)` switches between the former and the current dispatch."""
    from vllmpy import LLM, SamplingParams
    from vllmpy.entrypoints.bench.prompts import random_token_prompts, usable_token_ids

    llm = LLM(dtype="float32", max_model_len=1024, num_blocks=512)
    core, prof = llm.engine.core, profiling.profile()
    vocab = usable_token_ids(llm.get_tokenizer(), core.vocab_size)
    prompts = [{"prompt_token_ids": ids} for ids in random_token_prompts(vocab, 16, 128, 1)]
    run_state: dict = {}
    inner = core.step

    def step():  # times each step; the run's first (the prompts' last token) is left out of times and profiles
        if run_state["toggle"]:
            use(run_state["index"] % 2 == 1)
        prof.total = run_state["tally"] if run_state["index"] else profiling._Tally()
        start = time.perf_counter()
        result = inner()
        run_state["times"].append((run_state["index"] % 2 == 1, time.perf_counter() - start))
        run_state["index"] += 1
        return result
    core.step = step

    def run(batch: int, tokens: int, tally: profiling._Tally | None = None, toggle: bool = False):
        run_state.update(toggle=toggle, index=0, tally=tally or profiling._Tally(), times=[])
        llm.generate(prompts[:batch], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                     use_tqdm=False)
        return run_state["times"][1:]

    run(16, 2)  # the prompts into the prefix cache
    steps = run(16, 2 * pairs + 3, toggle=True)[1:]  # from an old step: (old, new) pairs
    old, new = [t for on, t in steps if not on], [t for on, t in steps if on]
    print(f"(A) batch-16 decode step, former / current dispatch: {_spread([o / n for o, n in zip(old, new)])}")
    tallies = {(on, b): profiling._Tally() for on in (False, True) for b in (1, 16)}
    scaling: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(reps):
        for on in (False, True):
            use(on)
            t1 = statistics.median(t for _, t in run(1, 9, tallies[(on, 1)]))
            t16 = statistics.median(t for _, t in run(16, 9, tallies[(on, 16)]))
            scaling[on].append(16 * t1 / t16)
    for on in (False, True):
        print(f"(B) {'current' if on else 'former'} dispatch, batch-16 / batch-1 decode tok/s: {_spread(scaling[on])}")
    if profiling.enabled():
        for (on, batch), tally in tallies.items():
            print(tally.report(f"{'current' if on else 'former'} dispatch, batch {batch} decode steps"))
    prof.total = profiling._Tally()  # printed above: nothing more at exit
    use(True)


Packed = tuple[int, torch.Tensor, int, int]  # ggml type, packed bytes, rows, cols


def _model_order() -> tuple[list[Packed], list[Packed], Packed]:
    """Every layer's 2-D packed weight in file order, layer 0's, and the head."""
    _, tensors = read_gguf(default_model_path())
    layers, first, head = [], [], None
    for tensor in tensors:
        if len(tensor.shape) != 2 or int(tensor.tensor_type) == 0:
            continue
        rows, cols = hf_shape(tensor)
        entry = (int(tensor.tensor_type), torch.from_numpy(tensor.data.view("uint8").reshape(rows, -1).copy()),
                 rows, cols)
        if tensor.name == "token_embd.weight":
            head = entry
        else:
            layers.append(entry)
            if tensor.name.startswith("blk.0."):
                first.append(entry)
    assert head is not None
    return layers, first, head


def _current(path: str | None):
    import ctypes

    from vllmpy.kernels import _bind_blocks
    return _bind_blocks(ctypes.CDLL(path)) if path else block_kernels()


def sweep(threads: int, reps: int, against: str | None, current: str | None) -> None:
    """--sweep of the module docstring."""
    import ctypes

    from vllmpy.kernels import _bind_blocks
    libs = {"current": _current(current)}
    if against:
        libs = {"old": _bind_blocks(ctypes.CDLL(against)), **libs}
    layers, first, head = _model_order()
    clock = time.thread_time if threads == 1 else time.perf_counter
    xs = {cols: torch.randn(1, cols) for cols in {t[3] for t in [*layers, head]}}
    y = torch.empty(1, head[2])

    def run(lib: ctypes.CDLL, tensors: list[Packed]) -> float:
        start = clock()
        for ggml_type, data, rows, cols in tensors:
            lib.vq_matmul(ggml_type, data.data_ptr(), data.shape[1], rows, cols, xs[cols].data_ptr(), 1,
                          y.data_ptr(), rows, threads)
        return clock() - start

    passes = {"layers in order": layers, "head": [head], f"layer 0 x{len(layers) // len(first)} (cached)":
              first * (len(layers) // len(first))}
    times = {(name, p): [] for name in libs for p in passes}
    for rep in range(reps + 1):  # the first round warms up and is dropped
        for name, lib in libs.items():
            for p, tensors in passes.items():
                t = run(lib, tensors)
                if rep:
                    times[(name, p)].append(t)
    for p, tensors in passes.items():
        size = sum(t[1].numel() for t in tensors)
        cells = [f"{name} {statistics.median(times[(name, p)]) * 1e3:7.2f} ms "
                 f"({size / statistics.median(times[(name, p)]) / 1e9:5.1f} GB/s)" for name in libs]
        if against:
            cells.append("old / current " + _spread([a / b for a, b in zip(times[("old", p)], times[("current", p)])]))
        print(f"{p:24} " + "   ".join(cells))


def rows_against(threads: int, reps: int, rows: list[int], head_rows: int, against: str, current: str | None) -> None:
    """--against without --sweep, as the module docstring says."""
    import ctypes

    from vllmpy.kernels import _bind_blocks
    libs = {"old": _bind_blocks(ctypes.CDLL(against)), "current": _current(current)}
    clock = time.thread_time if threads == 1 else time.perf_counter
    for name, ggml_type, data, (n, k) in _weights(head_rows):
        for m in rows:
            x, y = torch.randn(m, k), torch.empty(m, n)
            times: dict[str, list[float]] = {lib: [] for lib in libs}
            for rep in range(reps + 1):  # the first round warms up and is dropped
                for lib_name, lib in libs.items():
                    start = clock()
                    for _ in range(20):
                        lib.vq_matmul(ggml_type, data.data_ptr(), data.shape[1], n, k, x.data_ptr(), m, y.data_ptr(),
                                      n, threads)
                    if rep:
                        times[lib_name].append((clock() - start) / 20)
            cells = [f"{lib} {statistics.median(t) * 1e6:8.1f} us" for lib, t in times.items()]
            ratio = _spread([a / b for a, b in zip(times["old"], times["current"])])
            print(f"{name:24} {ggml_type:>4} {m:>4}  " + "  ".join(cells) + f"   old / current {ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 11, 16, 32])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--head-rows", type=int, default=16384, help="rows of the tied head to time (of 262144)")
    parser.add_argument("--engine", action="store_true", help="the end-to-end A/B on the default model instead")
    parser.add_argument("--pairs", type=int, default=20, help="--engine: (A)'s adjacent step pairs")
    parser.add_argument("--toggle", choices=sorted(TOGGLES), default="small",
                        help="--engine: the change measured (small: the small-batch kernel; amx: its AMX tiles)")
    parser.add_argument("--sweep", action="store_true", help="batch-1 calls over all layers and the head instead")
    parser.add_argument("--against", help="an earlier ggml_blocks .so to alternate with (--sweep, or vq_matmul per tensor)")
    parser.add_argument("--current", help="a ggml_blocks .so to time as current instead of the cached native build")
    args = parser.parse_args()
    if args.sweep:
        sweep(args.threads, args.reps, args.against, args.current)
        return
    if args.against:
        rows_against(args.threads, args.reps, args.rows, args.head_rows, args.against, args.current)
        return
    if args.engine:
        engine_ab(args.pairs, args.reps, TOGGLES[args.toggle])
        return
    weights = _weights(args.head_rows)
    print(f"{'tensor':24} {'type':>4} {'rows':>4}  " + "  ".join(f"{k + ' us':>18}" for k in KERNELS)
          + "   ratios to vq_matmul_small (median, min-max)")
    for name, ggml_type, data, shape in weights:
        for m in args.rows:
            x = torch.randn(m, shape[1])
            times: dict[str, list[float]] = {k: [] for k in KERNELS}
            for _ in range(args.reps + 1):  # the first round warms caches and is dropped below
                for kernel in KERNELS:
                    if m > 64 and kernel == "vq_matmul":
                        continue
                    t = _time(kernel, ggml_type, data, shape, x, args.threads)
                    if t is not None:
                        times[kernel].append(t)
            times = {k: v[1:] for k, v in times.items()}
            cells, ratios = [], []
            for kernel in KERNELS:
                cells.append(f"{statistics.median(times[kernel]) * 1e6:18.1f}" if times[kernel] else f"{'-':>18}")
                if times[kernel] and times["vq_matmul_small"] and kernel != "vq_matmul_small":
                    per_round = [a / b for a, b in zip(times[kernel], times["vq_matmul_small"])]
                    ratios.append(f"{kernel}: {statistics.median(per_round):.2f}x "
                                  f"({min(per_round):.2f}-{max(per_round):.2f})")
            print(f"{name:24} {ggml_type:>4} {m:>4}  " + "  ".join(cells) + "   " + "; ".join(ratios))


if __name__ == "__main__":
    main()
