"""vLLM's parallelism flags. Tensor parallel runs on the `mp` executor (worker processes on this host);
data parallel is vllm-server's (N engine processes behind it, distributed/dp_client.py); pipeline
parallel splits the layers over ranks on the same executors; `ray` places the ranks on a Ray cluster."""
from __future__ import annotations

from dataclasses import dataclass

# vLLM's --distributed-executor-backend names; "uni" is the one-process engine (TP=1).
EXECUTOR_BACKENDS = ("mp", "ray", "uni")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: "mp" when TP or PP > 1, else "uni" (vLLM's default)

    def validate(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}")
        if self.pipeline_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError(f"--pipeline-parallel-size {self.pipeline_parallel_size} with --tensor-parallel-size "
                             f"{self.tensor_parallel_size}: the two are not combined yet; use one of them")
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1 (engine processes behind one server), got "
                             f"{self.data_parallel_size}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"--distributed-executor-backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                             f"got {backend!r}")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"--distributed-executor-backend uni runs one process; --tensor-parallel-size "
                             f"{self.tensor_parallel_size} x --pipeline-parallel-size {self.pipeline_parallel_size} "
                             f"needs mp or ray")

    @property
    def world_size(self) -> int:
        """Ranks of one engine (data parallel engines are apart)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def refuse_offline_data_parallel(config: ParallelConfig) -> None:
    """One LLMEngine is one engine: N engines behind one frontend are vllm-server's. (vLLM's offline data
    parallel is another mode: one LLM per rank, launched together, each given its share of the prompts.)"""
    if config.data_parallel_size != 1:
        raise ValueError(f"--data-parallel-size {config.data_parallel_size}: data parallel runs behind "
                         f"vllm-server (N engine processes, one frontend); an offline LLM runs one engine, "
                         f"so only 1 is accepted here")
