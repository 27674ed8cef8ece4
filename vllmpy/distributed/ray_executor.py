"""The `ray` executor (`--distributed-executor-backend ray`): ranks 1..N-1 as Ray actors on a Ray cluster;
this process stays rank 0, the driver, as with mp (the scheduler, the sampler and the API server live
here, and its own forward feeds its sampler without a hop).

`ray.init()` joins the cluster RAY_ADDRESS names (none set: a local one, as vLLM), a placement group
reserves one bundle of VLLMPY_RAY_CPUS_PER_RANK CPUs (default 1) per rank, packed on as few nodes as
hold them; the bundle on the driver's node is rank 0's, an actor in each other bundle is a worker, with
that many torch threads. The group's TCP rendezvous is the driver's node address (as the cluster knows
it) and a free port. Multi-node: the same command on a node of the cluster (`ray start --head` there,
`ray start --address HEAD:PORT` on the others).
"""
from __future__ import annotations

import atexit
import logging
import os

import torch

from vllmpy.config import EngineConfig
from vllmpy.distributed.cpu_binding import Binding
from vllmpy.distributed.executor import JOIN_TIMEOUT_S, DriverExecutor, free_port
from vllmpy.distributed.pipeline import PARTITION_ENV
from vllmpy.distributed.worker import WorkerSpec, serve

logger = logging.getLogger("vllmpy")
# Seconds the cluster gets to place the ranks' bundles before the engine gives up (it may lack the CPUs).
PLACEMENT_TIMEOUT_S = 60.0


def import_ray():
    """ray, imported only when the ray executor is chosen; refused with the install hint when missing."""
    try:
        import ray
    except ImportError:
        raise ValueError("--distributed-executor-backend ray needs the ray package: pip install 'vllmpy[ray]' "
                         "(or use --distributed-executor-backend mp on one host)") from None
    return ray


class RankActor:
    """A worker rank inside a Ray actor: `serve` runs its whole life and returns at shutdown."""

    def __init__(self, threads: int) -> None:
        torch.set_num_threads(threads)

    def node_id(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def serve(self, spec: WorkerSpec, rank: int) -> None:
        serve(spec, rank)


class RayExecutor(DriverExecutor):
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype, task: str,
                 max_model_len: int) -> None:
        ray = self.ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(config)
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"))
        cpus = int(os.environ.get("VLLMPY_RAY_CPUS_PER_RANK", "1"))
        self.placement = placement_group([{"CPU": cpus}] * self.world, strategy="PACK")
        self.actors, self._serving_refs = [], []
        try:
            ray.get(self.placement.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise ValueError(f"the Ray cluster did not place {self.world} ranks of {cpus} CPU(s) each within "
                             f"{PLACEMENT_TIMEOUT_S:.0f} s (see `ray status`); add nodes or lower "
                             f"VLLMPY_RAY_CPUS_PER_RANK") from None
        driver_node = ray.get_runtime_context().get_node_id()
        bundles = ray.util.placement_group_table(self.placement)["bundles_to_node_id"]
        driver_bundle = next((b for b, node in bundles.items() if node == driver_node), 0)
        address = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == driver_node)
        spec = WorkerSpec(config, self.world, f"tcp://{address}:{free_port(address)}", device.type, dtype, task,
                          max_model_len, self.pipelined)
        actor_class = ray.remote(num_cpus=cpus)(RankActor)
        # Actors do not inherit this process's environment: the stage split's override travels explicitly.
        env = {name: os.environ[name] for name in (PARTITION_ENV,) if name in os.environ}
        for rank, bundle in enumerate([b for b in sorted(bundles) if b != driver_bundle], start=1):
            actor = actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement, placement_group_bundle_index=bundle),
                runtime_env={"env_vars": env} if env else None).remote(cpus)
            self.actors.append(actor)
        self._nodes = [actor.node_id.remote() for actor in self.actors]
        self._serving_refs = [actor.serve.remote(spec, rank) for rank, actor in enumerate(self.actors, start=1)]
        atexit.register(self.shutdown)  # a server's exit (or a script's end) leaves no actor behind
        self._binding = Binding(None, torch.get_num_threads())
        torch.set_num_threads(cpus)
        self._join(spec, device)
        self.nodes = {0: driver_node, **dict(enumerate(ray.get(self._nodes), start=1))}
        logger.info("ray executor: rank nodes %s", self.nodes)

    def _await_workers(self) -> None:
        self.ray.get(self._nodes, timeout=PLACEMENT_TIMEOUT_S)

    def _deaths(self) -> str:
        if not self._serving_refs:
            return ""
        done, _ = self.ray.wait(self._serving_refs, num_returns=len(self._serving_refs), timeout=0)
        deaths = ""
        for rank, ref in enumerate(self._serving_refs, start=1):
            if ref in done:
                try:
                    self.ray.get(ref)
                    reason = "returned"
                except Exception as exc:  # the actor died (RayActorError) or its loop raised
                    reason = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                deaths += f" worker rank {rank} (a Ray actor) {reason};"
        return deaths

    def _stop_workers(self, told: bool) -> None:
        from ray.util.placement_group import remove_placement_group

        if told and self._serving_refs:
            self.ray.wait(self._serving_refs, num_returns=len(self._serving_refs), timeout=JOIN_TIMEOUT_S)
        for actor in self.actors:
            self.ray.kill(actor)
        remove_placement_group(self.placement)
