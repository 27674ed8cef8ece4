"""What bounds the numbers: the machine (cores, memory, CPU flags, load), its measured memory read
bandwidth, and the weight bytes one decode step must read, hence the bandwidth limit on batch-1 decode."""
from __future__ import annotations

import contextlib
import os
import platform
import signal
import time
from collections.abc import Iterable, Iterator

import torch

# Vector/matrix extensions that decide which CPU kernels engines can use.
INTERESTING_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
                     "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd",
                     "sve")


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def _mem_total_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def _flags() -> set[str]:
    cpu = _cpuinfo()
    return set((cpu.get("flags") or cpu.get("Features") or "").split())


# Flags of a CPU that computes bf16 natively; elsewhere torch emulates bf16 and it only measures the emulation.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def native_bf16_flags() -> list[str]:
    """The BF16_FLAGS this CPU has (none: bfloat16 runs are not worth measuring by default)."""
    flags = _flags()
    return [f for f in BF16_FLAGS if f in flags]


def machine_facts() -> dict[str, str]:
    cpu = _cpuinfo()
    flags = _flags()
    return {
        "cpu": cpu.get("model name") or platform.processor() or platform.machine(),
        "cores": str(os.cpu_count()),
        "memory": f"{_mem_total_gib():.1f} GiB",
        "flags": " ".join(f for f in INTERESTING_FLAGS if f in flags) or "unknown",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch threads": str(torch.get_num_threads()),
    }


def load_average() -> float:
    return os.getloadavg()[0]


def _processes() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds used so far), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return out


def _trees(roots: Iterable[int], processes: dict[int, tuple[int, float]]) -> set[int]:
    """The roots and their descendants (a peer's server or worker and its own workers)."""
    tree = set(roots)
    for _ in range(4):
        tree |= {pid for pid, (parent, _) in processes.items() if parent in tree}
    return tree


class ForeignCpu:
    """Cores that processes other than this one and the measured engine's (`measured` roots and their
    children) kept busy between start and stop(): the load average cannot tell a benchmark's own threads
    from a neighbour's, and an idle peer engine that polls counts as a neighbour."""

    def __init__(self, measured: Iterable[int] = ()) -> None:
        self._measured = tuple(measured)
        self._before = _processes()
        self._start = time.monotonic()

    def stop(self) -> float:
        after = _processes()
        ours = {os.getpid()} | _trees(self._measured, after)
        used = sum(cpu - self._before.get(pid, (0, 0.0))[1] for pid, (_, cpu) in after.items() if pid not in ours)
        return max(used, 0.0) / (time.monotonic() - self._start)


@contextlib.contextmanager
def paused(roots: Iterable[int]) -> Iterator[None]:
    """SIGSTOP the process trees of the engines not being measured, SIGCONT them after: an idle vLLM
    engine core busy-polls a core, which halved vllmpy's prefill figure when it was left running."""
    tree = sorted(_trees(roots, _processes()))
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def memory_read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of the best of `repeats` full reads (a sum) of a `gib` GiB fp32 tensor with torch's threads:
    the same threads and memory path a decode step reads its weights through."""
    data = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def _weights(module: torch.nn.Module, element_size: int | None) -> list[tuple[int, int]]:
    """(storage address, bytes) of a module's own dense parameters and packed GGUF weights."""
    out = [(p.data_ptr(), p.numel() * (element_size or p.element_size()))
           for p in module.parameters(recurse=False) if p.numel()]
    for packed in [getattr(module, "packed", None), *getattr(module, "segments", [])]:
        if packed is not None:
            out.append((packed.data.data_ptr(), packed.shape[0] * packed.shape[1] * element_size if element_size
                        else packed.nbytes))
    return out


def weight_bytes_per_token(model: torch.nn.Module, element_size: int | None = None) -> int:
    """Bytes of weights one decode step reads: every parameter and packed GGUF weight once, except an
    untied input embedding table, of which a step reads one row. element_size: the same weights expanded
    to that many bytes a value (4: what transformers and vLLM fp32 hold, 2: vLLM bf16)."""
    sizes = {ptr: size for module in model.modules() for ptr, size in _weights(module, element_size)}
    embed = _weights(model.model.embed_tokens, element_size)
    head = _weights(model.lm_head, element_size) if hasattr(model, "lm_head") else []
    untied = sum(size for ptr, size in embed if ptr not in {p for p, _ in head})
    return sum(sizes.values()) - untied


def gguf_weight_bytes_per_token(path: str) -> int:
    """The same for a GGUF read as stored (quantized blocks): token_embd counts only when it is also the
    output head (no output.weight)."""
    from vllmpy.loader.gguf.file import read_gguf

    tensors = {t.name: t.data.nbytes for t in read_gguf(path)[1]}
    total = sum(tensors.values())
    return total - tensors.get("token_embd.weight", 0) if "output.weight" in tensors else total
