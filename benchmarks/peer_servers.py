"""OpenAI-compatible servers for workload (d): each started as a subprocess on a free port and ready once
/v1/models answers; vllm-bench serve's client then drives them all the same way."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import peer_engines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, command: list[str], port: int, timeout: float = 600.0,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.base_url = f"http://127.0.0.1:{port}"
        fd, self._log = tempfile.mkstemp(prefix=f"peer-{name.replace('.', '')}-", suffix=".log")
        self.proc = subprocess.Popen(command, stdout=fd, stderr=subprocess.STDOUT, env=env)
        os.close(fd)  # the server holds its own copy
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        message = f"{self.name} server not ready after {timeout:.0f}s:\n{self.log_tail()}"
        self.stop()
        raise RuntimeError(message)

    @property
    def pids(self) -> tuple[int, ...]:
        return (self.proc.pid,)

    def log_tail(self, lines: int = 20) -> str:
        with open(self._log) as f:
            return "".join(f.readlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        Path(self._log).unlink(missing_ok=True)


def vllmpy_server(model: str, max_model_len: int, max_num_seqs: int, dtype: str = "float32") -> Server:
    port = free_port()
    return Server(peer_engines.dtype_label("vllmpy", dtype),
                  [sys.executable, "-m", "vllmpy.entrypoints.openai.api_server", "--model", model, "--port",
                   str(port), "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs",
                   str(max_num_seqs), "--uvicorn-log-level", "warning"], port)


def llama_cpp_server(binary: str, gguf_path: str, max_model_len: int, slots: int, threads: int) -> Server:
    """llama.cpp's llama-server with one slot per client; its context is split evenly across the slots."""
    port = free_port()
    return Server("llama.cpp", [binary, "-m", gguf_path, "--port", str(port), "--parallel", str(slots),
                                "--ctx-size", str(max_model_len * slots), "--threads", str(threads),
                                "--threads-batch", str(threads), "--cont-batching"], port)


def vllm_server(python: str, hf_model: str, max_model_len: int, max_num_seqs: int, threads: int,
                dtype: str = "float32") -> Server:
    port = free_port()
    return Server(peer_engines.dtype_label("vllm", dtype),
                  [python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_model, "--port", str(port),
                   "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
                   "--kv-cache-memory-bytes", str(peer_engines.vllm_kv_cache_bytes(dtype))], port,
                  env=peer_engines.vllm_cpu_env(threads))


def llama_server_binary(flag: str | None, llama_python: str | None) -> str | None:
    """--llama-server, else the one beside llama-cpp-python's python (built from the same sources), else PATH's."""
    beside = Path(llama_python).with_name("llama-server") if llama_python else None
    path = flag or (str(beside) if beside and beside.exists() else shutil.which("llama-server"))
    return path if path and os.access(path, os.X_OK) else None
