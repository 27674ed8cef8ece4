"""The tensor-parallel group: this process's rank among the ranks of one model, and the collectives the
sharded layers call (torch.distributed: gloo on the CPU, NCCL on CUDA, chosen by the device).

One group per process, set once before the model is built (`init_group`); at TP=1 there is none and no
layer calls anything here.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A collective that waits this long means a peer is gone or stuck: fail rather than hang the engine.
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TPGroup:
    """rank 0 is the driver: it schedules, samples and receives the gathered logits."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial x, in place (row-parallel layers' outputs)."""
        dist.all_reduce(x)
        return x

    def gather_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x concatenated along the last dim on the driver; None on the other ranks."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.is_driver else None

    def broadcast_object(self, obj: object = None) -> object:
        """The driver's obj on every rank (the step's SchedulerOutput: plain data, pickled by torch)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def init_group(rank: int, world_size: int, init_method: str, device: torch.device) -> TPGroup:
    """Join the process group: gloo on the CPU, NCCL on CUDA (each rank on its own GPU)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return TPGroup(rank, world_size, device)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
