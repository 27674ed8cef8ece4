"""The block kernels' worker pool (vllmpy/kernels/thread_pool.h; its kernel user, the AMX small-batch tiles,
needs an AMX CPU, so the checks go through `vq_pool_fill`): every chunk runs exactly once whatever the thread
count (more threads than cores included), in a forked child whose parent had started the workers, and with
two callers at once."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from vllmpy import kernels


def _fill(threads: int, chunks: int) -> torch.Tensor:
    out = torch.zeros(chunks, dtype=torch.int64)
    kernels.block_kernels().vq_pool_fill(threads, chunks, out.data_ptr())
    return out


def _expected(chunks: int) -> torch.Tensor:
    return torch.arange(1, chunks + 1, dtype=torch.int64)


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_every_chunk_once(threads):
    for chunks in (0, 1, 7, 5000):
        assert torch.equal(_fill(threads, chunks), _expected(chunks)), (threads, chunks)


def test_pool_in_a_forked_child():
    """fork() copies no worker threads: the child's first call must start its own, not wait on the parent's."""
    assert torch.equal(_fill(2, 1000), _expected(1000))  # the parent's workers are running now
    pid = os.fork()
    if pid == 0:
        ok = all(torch.equal(_fill(2, 1000), _expected(1000)) for _ in range(20))
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's pool call did not return within 60 s")


def test_two_callers_at_once():
    """ctypes drops the GIL: two Python threads may call into the pool together; each gets its own result."""
    failures: list[int] = []

    def caller(i: int) -> None:
        for _ in range(200):
            if not torch.equal(_fill(2, 300 + i), _expected(300 + i)):
                failures.append(i)

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(60)
    assert not any(t.is_alive() for t in callers) and not failures
