"""vLLM's parallelism flags. Tensor parallel runs on the `mp` executor (worker processes on this host);
pipeline / data parallel and the Ray executor are refused by name until they are built."""
from __future__ import annotations

from dataclasses import dataclass

# vLLM's --distributed-executor-backend names; "uni" is the one-process engine (TP=1).
EXECUTOR_BACKENDS = ("mp", "ray", "uni")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: "mp" when TP > 1, else "uni" (vLLM's default)

    def validate(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"--pipeline-parallel-size {self.pipeline_parallel_size}: pipeline parallel is not "
                             f"built yet; only 1 is accepted (use --tensor-parallel-size to split a model)")
        if self.data_parallel_size != 1:
            raise ValueError(f"--data-parallel-size {self.data_parallel_size}: data parallel is not built yet; "
                             f"only 1 is accepted (run several servers behind a load balancer)")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"--distributed-executor-backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                             f"got {backend!r}")
        if backend == "ray":
            raise ValueError("--distributed-executor-backend ray is not built yet; use mp (worker processes on "
                             "this host)")
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(f"--distributed-executor-backend uni runs one process; --tensor-parallel-size "
                             f"{self.tensor_parallel_size} needs mp")
