"""Servers under test run as real subprocesses (`python -m vllmpy.entrypoints.openai.api_server --port 0`);
the URL is read from the line the server prints once it is ready."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

READY = re.compile(r"vllm-server: serving \S+ at (http://127\.0\.0\.1:\d+)/v1")


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None, timeout: float = 180.0) -> None:
        self._out = tempfile.NamedTemporaryFile("w+", suffix=".out")
        self._err = tempfile.NamedTemporaryFile("w+", suffix=".err")
        command = [sys.executable, "-m", "vllmpy.entrypoints.openai.api_server", "--host", "127.0.0.1",
                   "--port", "0", "--uvicorn-log-level", "warning", *args]
        self.proc = subprocess.Popen(command, stdout=self._out, stderr=self._err, env={**os.environ, **(env or {})})
        self.url = self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = READY.search(self.stdout)
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.stderr}")
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.stderr}")

    @property
    def stdout(self) -> str:
        return open(self._out.name).read()

    @property
    def stderr(self) -> str:
        return open(self._err.name).read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        self._err.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir):
    """The tiny random Llama (SmolLM2 tokenizer and chat template), served under the USAGE name "model"."""
    server = ServerProcess("--model", tiny_llama_dir, "--served-model-name", "model", "--num-blocks", "128",
                           "--max-model-len", "256")
    yield server
    server.stop()


def metric(text: str, name: str) -> float:
    """The value of an unlabelled-by-us sample (`name{model_name=...} value`) in Prometheus text."""
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))
