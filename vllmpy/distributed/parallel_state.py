"""The ranks of one model: this process's rank, and what the split layers call (torch.distributed: gloo
on the CPU, NCCL on CUDA, chosen by the device). Tensor parallel: collectives inside every layer;
pipeline parallel: point-to-point sends between consecutive stages.

One group per process, set once before the model is built (`init_group`); in one process there is none
and no layer calls anything here.
"""
from __future__ import annotations

import datetime
import pickle
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from vllmpy.distributed.shm_allreduce import ShmAllReduce, open_shm_allreduce

# A collective that waits this long means a peer is gone or stuck: fail rather than hang the engine.
COLLECTIVE_TIMEOUT_S = 120.0
# Pipeline point-to-point tags: the driver's steps (0: torch's recv_object_list), hidden states to the next
# stage, the last stage's logits back to the driver.
_STEP_TAG, _HIDDEN_TAG, _LOGITS_TAG = 0, 1, 2
# Sends kept unchecked before the oldest is waited for: a pipeline holds a few steps' messages at most.
_MAX_PENDING_SENDS = 64


@dataclass(frozen=True)
class RankGroup:
    """rank 0 is the driver: it schedules, samples and receives the logits."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def broadcast_object(self, obj: object = None) -> object:
        """The driver's obj on every rank (the step's SchedulerOutput: plain data, pickled by torch)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def partition(self, model: nn.Module) -> None:
        """Shrink the meta-device model to what this rank holds."""
        raise NotImplementedError


@dataclass(frozen=True)
class TPGroup(RankGroup):
    """Tensor parallel: every rank holds a shard of every layer."""

    shm: ShmAllReduce | None = field(default=None, compare=False)  # one host's segment (shm_allreduce.py)

    def partition(self, model: nn.Module) -> None:
        from vllmpy.layers.parallel import shard_model
        shard_model(model, self)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial x, in place (row-parallel layers' outputs): through shared memory
        when it fits a slot, else gloo / NCCL."""
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        dist.all_reduce(x)
        return x

    def gather_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x concatenated along the last dim on the driver; None on the other ranks."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.is_driver else None


@dataclass(frozen=True)
class PPGroup(RankGroup):
    """Pipeline parallel: rank r holds stage r's layers. Every send is asynchronous (a stage never waits for
    the next one to be free), so the driver can run stage 0 of one micro-batch while later stages run the
    one before it; the tensors of a send in flight are kept until it completes."""

    pending: deque = field(default_factory=deque, compare=False)  # (Work, tensors) of sends in flight

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def partition(self, model: nn.Module) -> None:
        from vllmpy.distributed.pipeline import split_stage
        split_stage(model, self)

    def send_step(self, obj: object) -> None:
        """The driver's step to every other stage, in the layout torch's recv_object_list reads (sizes, then
        bytes), without waiting for any stage to take it."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        for rank in range(1, self.world_size):
            self._send(size, rank, _STEP_TAG)
            self._send(data, rank, _STEP_TAG)

    def recv_step(self) -> object:
        box = [None]
        dist.recv_object_list(box, src=0)
        return box[0]

    def send_hidden(self, x: torch.Tensor) -> None:
        self._send(x.contiguous(), self.rank + 1, _HIDDEN_TAG)

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, self.rank - 1, tag=_HIDDEN_TAG)
        return x

    def send_logits(self, logits: torch.Tensor) -> None:
        self._send(logits.contiguous(), 0, _LOGITS_TAG)

    def recv_logits(self, rows: int, vocab: int) -> torch.Tensor:
        logits = torch.empty(rows, vocab, dtype=torch.float32, device=self.device)
        dist.recv(logits, self.world_size - 1, tag=_LOGITS_TAG)
        return logits

    def flush(self) -> None:
        """Wait until every send has been taken (before the group is torn down)."""
        while self.pending:
            self.pending.popleft()[0].wait()

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        while self.pending and (self.pending[0][0].is_completed() or len(self.pending) >= _MAX_PENDING_SENDS):
            self.pending.popleft()[0].wait()
        self.pending.append((dist.isend(tensor, dst, tag=tag), tensor))


def init_group(rank: int, world_size: int, init_method: str, device: torch.device,
               pipeline: bool = False) -> TPGroup | PPGroup:
    """Join the process group: gloo on the CPU, NCCL on CUDA (each rank on its own GPU). pipeline: the
    ranks are stages (--pipeline-parallel-size), else shards (--tensor-parallel-size)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    if pipeline:
        return PPGroup(rank, world_size, device)
    shm = None if device.type != "cpu" else open_shm_allreduce(rank, world_size, init_method, COLLECTIVE_TIMEOUT_S)
    return TPGroup(rank, world_size, device, shm)


def destroy_group(group: RankGroup | None = None) -> None:
    if isinstance(group, TPGroup) and group.shm is not None:
        group.shm.close()
    if dist.is_initialized():
        dist.destroy_process_group()
