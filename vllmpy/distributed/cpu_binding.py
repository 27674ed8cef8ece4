"""Give each rank its own cores, so N ranks on one host do not oversubscribe it (vLLM's
VLLM_CPU_OMP_THREADS_BIND idea): rank r gets the r-th of N equal runs of the cores this process may
use, and as many torch threads as cores in its run. VLLMPY_CPU_BIND=0 keeps the affinity and only
sets the threads.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Binding:
    """What a rank changed, so the driver (a library caller's process) can put it back at shutdown."""

    cores: frozenset[int] | None  # the affinity before, None when it was left alone
    threads: int


def bind_rank(rank: int, world_size: int) -> Binding:
    """Pin this process to its run of cores (when the OS allows) and size torch's thread pool to it."""
    before = Binding(None, torch.get_num_threads())
    if not hasattr(os, "sched_getaffinity"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        return before
    cores = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cores) // world_size)
    mine = cores[rank * per_rank:(rank + 1) * per_rank] if len(cores) >= world_size else cores
    if os.environ.get("VLLMPY_CPU_BIND", "1") != "0":
        os.sched_setaffinity(0, mine)
        before = Binding(frozenset(cores), before.threads)
    torch.set_num_threads(len(mine) if len(cores) >= world_size else 1)
    return before


def restore(binding: Binding) -> None:
    if binding.cores is not None:
        os.sched_setaffinity(0, binding.cores)
    torch.set_num_threads(binding.threads)
