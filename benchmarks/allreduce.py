"""Per-call all-reduce latency of gloo vs the shared-memory all-reduce (vllmpy/distributed/shm_allreduce.py)
between 2 spawned ranks on this host, one torch thread each, pinned as the engine pins them:
`python benchmarks/allreduce.py [--rounds 5] [--dtype float32]`. Sizes are the hidden states of 1, 16 and 64
tokens of a 640-wide model, then powers of two up to 262,144 elements; gloo and shm alternate in every
round (the host is shared), and the median of the rounds' per-call means is printed."""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch
import torch.distributed as dist

SIZES = [640, 640 * 16, 640 * 64, 65536, 131072, 262144, 1048576]
WORLD = 2


def _per_call_s(fn, x: torch.Tensor, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls


def _rank(rank: int, port: int, rounds: int, dtype: str, results) -> None:
    from vllmpy.distributed.cpu_binding import bind_rank
    from vllmpy.distributed.shm_allreduce import ShmAllReduce, _map_segment, segment_bytes

    bind_rank(rank, WORLD)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    slot = max(SIZES) * 8
    shm = ShmAllReduce(rank, WORLD, _map_segment(rank, f"/dev/shm/vllmpy-bench-{port}", segment_bytes(WORLD, slot)),
                       60.0, slot)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for n in SIZES:
            x = torch.randn(n).to(getattr(torch, dtype))
            calls = max(20, min(500, 2_000_000 // n))
            for name, fn in (("gloo", dist.all_reduce), ("shm", shm.all_reduce)):
                fn(x)  # warm
                times.setdefault((name, n), []).append(_per_call_s(fn, x, calls))
    if rank == 0:
        results.put({key: statistics.median(v) for key, v in times.items()})
    shm.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    from vllmpy.distributed.executor import free_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank, args=(r, port, args.rounds, args.dtype, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    medians = results.get()
    for p in procs:
        p.join()
    print(f"{'elements':>9} {'bytes':>9} {'gloo us':>9} {'shm us':>9} {'gloo/shm':>8}  ({args.dtype}, {WORLD} ranks,"
          f" 1 thread each, median of {args.rounds} interleaved rounds)")
    for n in SIZES:
        g, s = medians[("gloo", n)], medians[("shm", n)]
        size = n * torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
        print(f"{n:>9} {size:>9} {g * 1e6:>9.1f} {s * 1e6:>9.1f} {g / s:>8.2f}")


if __name__ == "__main__":
    main()
