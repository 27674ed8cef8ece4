"""The driver's side of an engine over several ranks, and the `mp` executor (ranks 1..N-1 as spawned
processes on this host; this process is rank 0, the driver). ray_executor.py places them on Ray instead.

Tensor parallel: each step the driver broadcasts the plain SchedulerOutput (torch's
broadcast_object_list: one pickle, whatever N), then runs its own forward; every rank's forward meets in
the same all-reduces, and the logits are gathered on the driver, which samples.
Pipeline parallel: the driver sends each micro-batch's SchedulerOutput to every stage without waiting,
runs stage 0 (`submit`), and samples once the last stage's logits are back (`complete`); up to PP
micro-batches are in flight between the two (engine/batch_queue.py), so the stages overlap.
A worker that dies (or a step that raises partway through its collectives) stops the engine with
DistributedEngineError instead of hanging it: liveness is checked before every step, and a collective
or receive whose peer is gone fails (gloo: at once when the socket closes; at worst after
parallel_state.COLLECTIVE_TIMEOUT_S).
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
from vllmpy.distributed.cpu_binding import Binding, bind_rank, restore
from vllmpy.distributed.errors import DistributedEngineError
from vllmpy.distributed.parallel_state import PPGroup, destroy_group, init_group
from vllmpy.distributed.worker import WorkerSpec, run_worker
from vllmpy.engine.kv_cache_spec import KVCacheConfig
from vllmpy.engine.schedule_types import ModelRunnerOutput, SchedulerOutput
from vllmpy.runner.model_runner import ForwardedStep, ModelRunner

logger = logging.getLogger("vllmpy")
# Seconds a worker gets to leave after the shutdown message before it is killed.
JOIN_TIMEOUT_S = 10.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class DriverExecutor:
    """Rank 0: joins the group with the workers the subclass placed, then runs every step's driver side.
    Subclasses start the workers, say which have died (`_deaths`) and stop them (`_stop_workers`)."""

    # The process's executor: torch.distributed has one default group per process, so one engine at a time.
    _current: DriverExecutor | None = None

    def __init__(self, config: EngineConfig) -> None:
        previous = DriverExecutor._current
        if previous is not None and not previous._closed:
            if previous.runner is not None:
                raise ValueError("a multi-rank engine is already running in this process; shut it down first "
                                 "(llm.engine.core.shutdown())")
            previous.shutdown()  # an engine whose start failed after its workers were spawned
        DriverExecutor._current = self
        self.world = config.parallel.world_size
        self.pipelined = config.parallel.pipeline_parallel_size > 1
        self.mode = "pipeline-parallel" if self.pipelined else "tensor-parallel"
        self.runner: ModelRunner | None = None
        self.group = None
        self._closed = False
        self._serving = False  # the workers took the KV layout and wait for steps
        self._binding: Binding | None = None
        self.in_flight = 0  # micro-batches submitted and not completed
        self.max_in_flight = 0  # the most at once since start (pipeline parallel overlaps its stages)

    def _join(self, spec: WorkerSpec, device: torch.device) -> None:
        """Join the group as rank 0 (after the subclass started the workers), or stop them and raise."""
        try:
            self._await_workers()
            self.group = init_group(0, self.world, spec.init_method, device, self.pipelined)
        except Exception as exc:
            self.shutdown()
            raise DistributedEngineError(f"{self.mode} workers did not join: {exc}{self._deaths()}") from exc
        logger.info("%s: %d ranks (%s executor, %s), %d torch threads on the driver", self.mode, self.world,
                    type(self).__name__, _backend(self.group, device), torch.get_num_threads())

    def start(self, runner: ModelRunner, kv_cache_config: KVCacheConfig) -> None:
        """The driver's runner, and the KV pool every worker allocates its part of the cache by."""
        self.runner = runner
        self._collective(self.group.broadcast_object, kv_cache_config)
        self._serving = True

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.complete(self.submit(scheduler_output))

    def submit(self, scheduler_output: SchedulerOutput) -> ForwardedStep:
        """Hand the step to every rank and run the driver's forward (stage 0 under pipeline parallel)."""
        step = self._collective(self._submit, scheduler_output)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return step

    def complete(self, step: ForwardedStep) -> ModelRunnerOutput:
        """Sample the step (pipeline parallel: once the last stage's logits are back)."""
        out = self._collective(self.runner.finish_step, step)
        self.in_flight -= 1
        return out

    def _submit(self, scheduler_output: SchedulerOutput) -> ForwardedStep:
        self._send(scheduler_output)
        return self.runner.forward_step(scheduler_output)

    def _send(self, message: SchedulerOutput | None) -> None:
        if isinstance(self.group, PPGroup) and self._serving:
            self.group.send_step(message)
        else:
            self.group.broadcast_object(message)

    def _collective(self, fn, *args):
        """fn(*args), or DistributedEngineError when a rank is gone or fn fails (the ranks' collectives
        can no longer be matched)."""
        if self._closed:
            raise DistributedEngineError(f"the {self.mode} engine has stopped")
        deaths = self._deaths()
        if deaths:
            self.shutdown()
            raise DistributedEngineError(f"the {self.mode} engine stopped:{deaths}")
        try:
            return fn(*args)
        except Exception as exc:
            self.shutdown()
            raise DistributedEngineError(f"a {self.mode} step failed ({type(exc).__name__}: {exc}); the ranks "
                                         f"are out of step, so the engine stopped{self._deaths()}") from exc

    def _await_workers(self) -> None:
        """Return when every worker is about to join the group; raise as soon as one has failed."""

    def _deaths(self) -> str:
        """' worker rank R (...) ...;' for every worker that has exited, '' while all are alive."""
        raise NotImplementedError

    def _stop_workers(self, told: bool) -> None:
        """Wait for the workers to leave (told: they got the shutdown message), ending any that do not."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Tell the workers to leave, wait for them, end any that do not; put the driver's cores back."""
        if self._closed:
            return
        self._closed = True
        told = False
        if not self._deaths() and self.group is not None:
            try:
                self._send(None)
                if isinstance(self.group, PPGroup):
                    self.group.flush()
                told = True
            except Exception:  # a worker died meanwhile: the stops below end the rest
                logger.warning("%s: the shutdown message failed", self.mode)
        self._stop_workers(told)
        destroy_group(self.group)
        if self._binding is not None:
            restore(self._binding)


def _backend(group: object, device: torch.device) -> str:
    if getattr(group, "shm", None) is not None:
        return f"gloo, shared-memory all-reduce up to {group.shm.slot_bytes} bytes"
    return "gloo" if device.type == "cpu" else "nccl"


def _await_processes(receivers: list[Connection], workers: list[BaseProcess]) -> None:
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


class MultiprocExecutor(DriverExecutor):
    """Spawn the workers (they load their parts while the driver loads its own) and join the group."""

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype, task: str,
                 max_model_len: int) -> None:
        super().__init__(config)
        spec = WorkerSpec(config, self.world, f"tcp://127.0.0.1:{free_port()}", device.type, dtype, task,
                          max_model_len, self.pipelined)
        # spawn: no forked torch / OpenMP state in the children (a script must guard its entry point with
        # `if __name__ == "__main__":`, as with vLLM)
        context = multiprocessing.get_context("spawn")
        pipes = [context.Pipe(duplex=False) for _ in range(1, self.world)]
        kind = "pp" if self.pipelined else "tp"
        self.workers = [context.Process(target=run_worker, args=(spec, rank, sender), name=f"vllmpy-{kind}-rank{rank}",
                                        daemon=True) for rank, (_, sender) in enumerate(pipes, start=1)]
        for worker in self.workers:
            worker.start()
        atexit.register(self.shutdown)  # a server's exit (or a script's end) leaves no worker behind
        self._binding = bind_rank(0, self.world)
        self._receivers = [receiver for receiver, _ in pipes]
        self._join(spec, device)

    def _await_workers(self) -> None:
        _await_processes(self._receivers, self.workers)

    def _deaths(self) -> str:
        return "".join(f" worker rank {rank} (pid {w.pid}) exited with code {w.exitcode};"
                       for rank, w in enumerate(self.workers, start=1) if w.exitcode is not None)

    def _stop_workers(self, told: bool) -> None:
        for worker in self.workers:  # a worker not told waits for a message that never comes: kill it
            worker.join(JOIN_TIMEOUT_S if told else 0)
            if worker.exitcode is None:
                worker.kill()
                worker.join()
