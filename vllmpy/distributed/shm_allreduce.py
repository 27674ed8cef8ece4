"""A shared-memory all-reduce for the tensor-parallel ranks of one host (vLLM's CPU communicator idea):
gloo's all-reduce goes through the loopback TCP stack, two copies and a few wake-ups per call, which is
most of a small decode step's all-reduce time; here each rank copies its partial into its slot of one
mmap'ed segment, bumps its sequence counter, waits until every rank's counter reached the call's, and
sums the slots itself.

Layout: one 64-byte line per rank (its sequence counter, its pid), then two buffers of `world` slots
used by alternate calls. A rank starts writing call k + 2 into the buffer of call k only after it saw
every rank arrive at call k + 1, and a rank arrives at k + 1 only after it finished reading call k, so
one barrier per call keeps a slot from being overwritten while it is read (the double buffer is the
second barrier). Every rank adds the slots in rank order (low-precision dtypes in float32), so all
ranks get bit-identical sums.

The segment is a file under /dev/shm named after the group's rendezvous port, created by rank 0 and
unlinked as soon as every rank has mapped it: the mappings live on, and nothing is left behind however
the processes end. Tensors larger than a slot go to gloo (`TPGroup.all_reduce`), as do groups that span
hosts and non-CPU devices (never built for them).
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

# Bytes of one rank's slot: larger all-reduces go to gloo (benchmarks/allreduce.py: shm is 5x faster per
# call at 1 MiB and even at 4 MiB on the 2-core host; a decode step's hidden states fit).
SLOT_BYTES = 1 << 20
# VLLMPY_TP_ALLREDUCE values: auto (shm for what fits a slot, on one host not oversubscribed), shm
# (whatever the load; an error when the group cannot have it), gloo (never build it).
MODES = ("auto", "shm", "gloo")
_LINE = 64  # one cache line per rank's counter: ranks never write the same line
# A waiting rank polls for _SPIN_S, then sleeps in the kernel on the late rank's counter (a futex, woken by
# that rank's store): on a host with more runnable threads than cores, a rank that spins or naps in
# user space loses the core to other processes for its own compute, and the measured decode rate fell
# below gloo's (`VLLMPY_TP_SHM_SPIN_S=1`, one second of spinning, reproduces that in
# benchmarks/parallel_decode.py).
_SPIN_S = float(os.environ.get("VLLMPY_TP_SHM_SPIN_S", "2e-5"))
_CHECK_EVERY_S = 0.5  # how often a waiting rank looks for dead peers
logger = logging.getLogger("vllmpy")
_fence_lock = threading.Lock()  # acquire/release is a full memory barrier (orders the slot before the counter)
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): the waiters are other processes
_libc = ctypes.CDLL(None, use_errno=True) if _SYS_FUTEX is not None and sys.platform == "linux" else None


def allreduce_mode() -> str:
    mode = os.environ.get("VLLMPY_TP_ALLREDUCE", "auto")
    if mode not in MODES:
        raise ValueError(f"VLLMPY_TP_ALLREDUCE must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


class ShmAllReduce:
    """One rank's view of the group's segment. Every rank must call all_reduce in the same order with the
    same sizes (the layers' forwards do)."""

    def __init__(self, rank: int, world_size: int, segment: mmap.mmap, timeout_s: float,
                 slot_bytes: int = SLOT_BYTES) -> None:
        """Collective over the default process group: every rank publishes its pid in the segment."""
        self.rank, self.world, self.slot_bytes, self.timeout_s = rank, world_size, slot_bytes, timeout_s
        self._mm = segment
        self._words = memoryview(segment).cast("i")  # int32 words: rank r's counter at r * 16, its pid next
        self._stride = _LINE // 4
        anchor = ctypes.c_char.from_buffer(segment)
        self._base = ctypes.addressof(anchor)  # the counters' addresses, for the futex calls
        del anchor
        self._nap = _Timespec(0, int(_CHECK_EVERY_S * 1e9))
        self._words[rank * self._stride + 1] = os.getpid()
        self._data = torch.frombuffer(segment, dtype=torch.uint8, offset=_LINE * world_size)
        self._seq = 0
        dist.barrier()  # every pid is written before anyone waits on a counter
        self._pids = [self._words[r * self._stride + 1] for r in range(world_size)]

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (x must fit a slot)."""
        self._seq = (self._seq + 1) & 0x7FFFFFFF  # wraps; _arrived compares modulo 2**31
        nbytes = x.numel() * x.element_size()
        buffer = self._data[(self._seq % 2) * self.world * self.slot_bytes:][:self.world * self.slot_bytes]
        slots = buffer.view(self.world, self.slot_bytes)[:, :nbytes].view(x.dtype).view(self.world, *x.shape)
        slots[self.rank].copy_(x)
        with _fence_lock:
            self._words[self.rank * self._stride] = self._seq
        if _libc is not None:
            _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self._base + self.rank * _LINE), _FUTEX_WAKE,
                          self.world, None, None, 0)
        self._wait(self._seq)
        if x.dtype in (torch.float32, torch.float64):
            x.copy_(slots[0])
            for r in range(1, self.world):
                x.add_(slots[r])
        else:
            acc = slots[0].float()
            for r in range(1, self.world):
                acc.add_(slots[r])
            x.copy_(acc)
        return x

    def _wait(self, seq: int) -> None:
        """Spin, then sleep on the late ranks' counters, until every rank reached seq; raise naming a rank
        that died or did not arrive within timeout_s."""
        words, stride = self._words, self._stride
        start = check = time.monotonic()
        for r in range(self.world):
            while r != self.rank and not _arrived(value := words[r * stride], seq):
                now = time.monotonic()
                if now - start < _SPIN_S:
                    continue
                if _libc is None:
                    time.sleep(1e-5)
                else:  # returns when rank r stores (and wakes), or the value already changed, or after _nap
                    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self._base + r * _LINE), _FUTEX_WAIT, value,
                                  ctypes.byref(self._nap), None, 0)
                if now - check >= _CHECK_EVERY_S:
                    check = now
                    if not _alive(self._pids[r]):
                        raise RuntimeError(f"shared-memory all-reduce: tensor-parallel rank {r} (pid "
                                           f"{self._pids[r]}) is gone")
                    if now - start > self.timeout_s:
                        raise RuntimeError(f"shared-memory all-reduce: tensor-parallel rank {r} did not "
                                           f"arrive within {self.timeout_s:.0f} s (call {seq})")
        with _fence_lock:  # the slots are read after the counters
            pass

    def close(self) -> None:
        """Drop the mapping (the file is already unlinked)."""
        del self._data
        self._words.release()
        self._mm.close()


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _arrived(value: int, seq: int) -> bool:
    """value (a rank's counter) is at seq or one call past it, modulo 2**31."""
    return (value - seq) & 0x7FFFFFFF in (0, 1)


def _alive(pid: int) -> bool:
    """False once pid has exited (a zombie counts as exited: the driver reaps its workers late)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def segment_bytes(world_size: int, slot_bytes: int = SLOT_BYTES) -> int:
    return _LINE * world_size + 2 * world_size * slot_bytes


def open_shm_allreduce(rank: int, world_size: int, init_method: str, timeout_s: float,
                       slot_bytes: int = SLOT_BYTES) -> ShmAllReduce | None:
    """The group's segment when VLLMPY_TP_ALLREDUCE allows it and every rank could map it (one host);
    None (gloo for every all-reduce) otherwise. Collective: every rank calls it, all get the same answer."""
    mode = allreduce_mode()
    if mode == "gloo" or world_size == 1:
        return None
    hosts: list[object] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    if mode == "auto" and _oversubscribed(rank):
        logger.info("tensor-parallel: gloo all-reduce (the host's load average exceeds its cores, where the "
                    "shared-memory one measured slower; VLLMPY_TP_ALLREDUCE=shm forces it)")
        return None
    segment = None
    if len(set(hosts)) == 1:
        segment = _map_segment(rank, f"/dev/shm/vllmpy-tp-{init_method.rsplit(':', 1)[-1]}",
                               segment_bytes(world_size, slot_bytes))
    if segment is None:
        if mode == "shm":
            raise ValueError(f"VLLMPY_TP_ALLREDUCE=shm: the {world_size} tensor-parallel ranks could not share "
                             f"a /dev/shm segment (they are on {len(set(hosts))} host(s)); use auto or gloo")
        return None
    return ShmAllReduce(rank, world_size, segment, timeout_s, slot_bytes)


def _oversubscribed(rank: int) -> bool:
    """Rank 0's verdict, on every rank: does the load average (our starting ranks included) exceed the
    cores? Per call the shared-memory all-reduce is 5-80x faster than gloo (benchmarks/allreduce.py),
    but on an oversubscribed host a rank that rarely sleeps in a socket wait loses the scheduler's favour
    for its compute, and TP=2 decode measured 0.5-0.65x gloo's (benchmarks/parallel_decode.py, 2 cores
    at load ~7)."""
    verdict = [os.getloadavg()[0] > (os.cpu_count() or 1) if rank == 0 else None]
    dist.broadcast_object_list(verdict, src=0)
    return bool(verdict[0])


def _map_segment(rank: int, path: str, size: int) -> mmap.mmap | None:
    """Rank 0 creates path, every rank maps it, rank 0 unlinks it; None on every rank unless all mapped it
    (a rank whose /dev/shm is another one, as in a container: the file is not there)."""
    fd = -1
    if rank == 0:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
        except OSError as exc:
            logger.warning("shared-memory all-reduce: cannot create %s (%s); using gloo", path, exc)
    dist.barrier()
    segment = None
    try:
        if rank != 0:
            fd = os.open(path, os.O_RDWR)
        if fd >= 0:
            segment = mmap.mmap(fd, size)
    except (OSError, ValueError):  # not there, or shorter than size (rank 0 could not size it)
        segment = None
    finally:
        if fd >= 0:
            os.close(fd)
    mapped: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(mapped, segment is not None)
    if rank == 0 and fd >= 0:
        os.unlink(path)
    if all(mapped):
        return segment
    if segment is not None:
        segment.close()
    return None
