"""The `mp` executor: ranks 1..N-1 as spawned processes on this host, this process as rank 0 (the driver).

Each step the driver broadcasts the plain SchedulerOutput (torch's broadcast_object_list: one pickle,
whatever N), then runs its own forward; every rank's forward meets in the same all-reduces, and the
logits are gathered on the driver, which samples. A worker that dies (or a step that raises partway
through its collectives) stops the engine with DistributedEngineError instead of hanging it: liveness
is checked before every broadcast, and a collective whose peer is gone fails (gloo: at once when the
socket closes; at worst after parallel_state.COLLECTIVE_TIMEOUT_S).
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import socket
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch

from vllmpy.config import EngineConfig
from vllmpy.distributed.cpu_binding import bind_rank, restore
from vllmpy.distributed.errors import DistributedEngineError
from vllmpy.distributed.parallel_state import destroy_group, init_group
from vllmpy.distributed.worker import WorkerSpec, run_worker
from vllmpy.engine.kv_cache_spec import KVCacheConfig
from vllmpy.engine.schedule_types import ModelRunnerOutput, SchedulerOutput
from vllmpy.runner.model_runner import ModelRunner

logger = logging.getLogger("vllmpy")
# Seconds a worker gets to leave after the shutdown broadcast before it is killed.
_JOIN_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _await_workers(receivers: list[Connection], workers: list[BaseProcess]) -> None:
    """Wait until every worker is about to join the group, or fail as soon as one has exited (a worker
    that dies while starting would otherwise leave the driver in the rendezvous until its timeout)."""
    pending = {receiver: worker for receiver, worker in zip(receivers, workers)}
    while pending:
        ready = wait([*pending, *(worker.sentinel for worker in pending.values())])
        for receiver in [r for r in pending if r in ready]:
            try:
                receiver.recv()
            except EOFError:  # it exited before it was ready
                raise RuntimeError("a worker exited while starting") from None
            del pending[receiver]
        if any(worker.sentinel in ready for worker in pending.values()):
            raise RuntimeError("a worker exited while starting")


class MultiprocExecutor:
    """Spawn the workers (they load their shards while the driver loads its own) and join the group."""

    # The process's executor: torch.distributed has one default group per process, so one engine at a time.
    _current: MultiprocExecutor | None = None

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype, task: str,
                 max_model_len: int) -> None:
        previous = MultiprocExecutor._current
        if previous is not None and not previous._closed:
            if previous.runner is not None:
                raise ValueError("a tensor-parallel engine is already running in this process; shut it down "
                                 "first (llm.engine.core.shutdown())")
            previous.shutdown()  # an engine whose start failed after its workers were spawned
        MultiprocExecutor._current = self
        world = config.parallel.tensor_parallel_size
        spec = WorkerSpec(config, world, f"tcp://127.0.0.1:{_free_port()}", device.type, dtype, task, max_model_len)
        # spawn: no forked torch / OpenMP state in the children (a script must guard its entry point with
        # `if __name__ == "__main__":`, as with vLLM)
        context = multiprocessing.get_context("spawn")
        pipes = [context.Pipe(duplex=False) for _ in range(1, world)]
        self.workers = [context.Process(target=run_worker, args=(spec, rank, sender), name=f"vllmpy-tp-rank{rank}",
                                        daemon=True) for rank, (_, sender) in enumerate(pipes, start=1)]
        for worker in self.workers:
            worker.start()
        atexit.register(self.shutdown)  # a server's exit (or a script's end) leaves no worker behind
        self._binding = bind_rank(0, world)
        self.runner: ModelRunner | None = None
        self._closed = False
        try:
            _await_workers([receiver for receiver, _ in pipes], self.workers)
            self.group = init_group(0, world, spec.init_method, device)
        except Exception as exc:
            self.shutdown()
            raise DistributedEngineError(f"tensor-parallel workers did not join: {exc}{self._deaths()}") from exc
        logger.info("tensor parallel: %d ranks (mp executor, %s), %d torch threads per rank", world,
                    "gloo" if device.type == "cpu" else "nccl", torch.get_num_threads())

    def start(self, runner: ModelRunner, kv_cache_config: KVCacheConfig) -> None:
        """The driver's runner, and the KV layout every worker allocates its shard of the cache by."""
        self.runner = runner
        self._collective(self.group.broadcast_object, kv_cache_config)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._collective(self.group.broadcast_object, scheduler_output)
        return self._collective(self.runner.execute, scheduler_output)

    def _collective(self, fn, *args):
        """fn(*args), or DistributedEngineError when a rank is gone or fn fails (the ranks' collectives
        can no longer be matched)."""
        if self._closed:
            raise DistributedEngineError("the tensor-parallel engine has stopped")
        deaths = self._deaths()
        if deaths:
            self.shutdown()
            raise DistributedEngineError(f"the tensor-parallel engine stopped:{deaths}")
        try:
            return fn(*args)
        except Exception as exc:
            self.shutdown()
            raise DistributedEngineError(f"a tensor-parallel step failed ({type(exc).__name__}: {exc}); the "
                                         f"ranks are out of step, so the engine stopped{self._deaths()}") from exc

    def _deaths(self) -> str:
        return "".join(f" worker rank {rank} (pid {w.pid}) exited with code {w.exitcode};"
                       for rank, w in enumerate(self.workers, start=1) if w.exitcode is not None)

    def shutdown(self) -> None:
        """Tell the workers to leave, wait for them, kill any that do not; put the driver's cores back."""
        if self._closed:
            return
        self._closed = True
        told = False
        if not self._deaths() and getattr(self, "group", None) is not None:
            try:
                self.group.broadcast_object(None)
                told = True
            except Exception:  # a worker died meanwhile: the kills below end the rest
                logger.warning("tensor parallel: the shutdown broadcast failed")
        for worker in self.workers:  # a worker not told waits in a collective that never comes: kill it
            worker.join(_JOIN_TIMEOUT_S if told else 0)
            if worker.exitcode is None:
                worker.kill()
                worker.join()
        destroy_group()
        restore(self._binding)
