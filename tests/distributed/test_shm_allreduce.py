"""The shared-memory all-reduce between 2 spawned ranks: sums equal on every rank bit for bit and to the float64
sum within the dtype's rounding (tensors larger than a slot through gloo), a peer that stops or dies fails
the call naming its rank, and no segment is left in /dev/shm."""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from vllmpy.distributed.executor import free_port
from vllmpy.distributed.parallel_state import TPGroup
from vllmpy.distributed.shm_allreduce import allreduce_mode, open_shm_allreduce

SLOT = 64 * 1024  # small, so the 40,000-element float32 case goes to gloo
CASES = [((1,), torch.float32), ((640,), torch.float32), ((16, 640), torch.float32), ((7, 333), torch.bfloat16),
         ((64, 640), torch.bfloat16), ((40_000,), torch.float32)]
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}  # relative, one rounding of the sum


def _partial(rank: int, case: int) -> torch.Tensor:
    shape, dtype = CASES[case]
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * case + rank)).to(dtype)


def _join(rank: int, port: int, timeout_s: float) -> TPGroup:
    init = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    return TPGroup(rank, 2, torch.device("cpu"), open_shm_allreduce(rank, 2, init, timeout_s, SLOT))


def _sums(rank: int, port: int, report) -> None:
    group = _join(rank, port, 30.0)
    problems = [] if group.shm is not None else ["no segment"]
    for case, (shape, dtype) in enumerate(CASES):
        for _ in range(3):  # both buffers, then the first again
            got = group.all_reduce(_partial(rank, case))
            want = _partial(0, case).double() + _partial(1, case).double()
            error = ((got.double() - want).abs() / want.abs().clamp_min(1.0)).max().item()
            if error > TOLERANCE[dtype]:
                problems.append(f"case {case}: relative error {error:.2e}")
            other = [torch.empty_like(got) for _ in range(2)]
            dist.all_gather(other, got)
            if not torch.equal(other[0], other[1]):
                problems.append(f"case {case}: ranks differ")
    report.put((rank, problems))
    group.shm.close()
    dist.destroy_process_group()


def _stalls_then_dies(rank: int, port: int, report) -> None:
    group = _join(rank, port, 30.0)
    if rank == 1:
        time.sleep(3.0)  # alive, never arriving
        os._exit(0)
    errors = []
    for timeout_s in (1.0, 30.0):  # first the timeout, then (rank 1 gone at 3 s) the dead peer
        group.shm.timeout_s = timeout_s
        start = time.monotonic()
        try:
            group.shm.all_reduce(torch.ones(8))
            errors.append(("returned", 0.0))
        except RuntimeError as exc:
            errors.append((str(exc), time.monotonic() - start))
    report.put((rank, errors))


def _spawn(target, port: int) -> list:
    context = multiprocessing.get_context("spawn")
    report = context.Queue()
    procs = [context.Process(target=target, args=(rank, port, report)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        return [report.get(timeout=60) for _ in range(len(procs) if target is _sums else 1)]
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()


def test_sums_equal_across_ranks_and_to_float64_and_no_segment_left(monkeypatch):
    monkeypatch.setenv("VLLMPY_TP_ALLREDUCE", "shm")  # the children inherit it: whatever the host's load
    port = free_port()
    reports = dict(_spawn(_sums, port))
    assert reports == {0: [], 1: []}
    assert not os.path.exists(f"/dev/shm/vllmpy-tp-{port}")


def test_a_stalled_then_dead_peer_fails_naming_its_rank(monkeypatch):
    monkeypatch.setenv("VLLMPY_TP_ALLREDUCE", "shm")
    port = free_port()
    [(rank, errors)] = _spawn(_stalls_then_dies, port)
    (stalled, stalled_s), (dead, dead_s) = errors
    assert "rank 1 did not arrive within 1 s" in stalled and 1.0 <= stalled_s < 10.0
    assert "rank 1 (pid" in dead and "is gone" in dead and dead_s < 10.0
    assert not os.path.exists(f"/dev/shm/vllmpy-tp-{port}")


def test_mode_names_the_variable_and_its_values(monkeypatch):
    monkeypatch.setenv("VLLMPY_TP_ALLREDUCE", "nccl")
    with pytest.raises(ValueError, match="VLLMPY_TP_ALLREDUCE must be one of auto, shm, gloo"):
        allreduce_mode()
