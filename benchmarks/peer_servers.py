"""OpenAI-compatible servers for workload (d): each started as a subprocess on a free port and ready once
/v1/models answers; vllm-bench serve's client then drives them all the same way. llama-server with its
draftless n-gram speculation (--spec-type) is also an (e)/(f) engine: LlamaServerEngine times batch-1
completions through its native /completion endpoint as the in-process engines time generate()."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
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


def vllmpy_server(model: str, max_model_len: int, max_num_seqs: int, dtype: str = "float32",
                  speculative_config: str | None = None, name: str | None = None) -> Server:
    port = free_port()
    spec = ["--speculative-config", speculative_config] if speculative_config else []
    return Server(name or peer_engines.dtype_label("vllmpy", dtype),
                  [sys.executable, "-m", "vllmpy.entrypoints.openai.api_server", "--model", model, "--port",
                   str(port), "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs",
                   str(max_num_seqs), "--uvicorn-log-level", "warning", *spec], port)


SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


def spec_counters(server: Server) -> tuple[int, int, int]:
    """(drafts, draft tokens, accepted tokens) so far, from the server's Prometheus /metrics (0 where absent)."""
    totals = dict.fromkeys(SPEC_COUNTERS, 0)
    for line in httpx.get(f"{server.base_url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        name = name.removesuffix("_total")
        if name in totals:
            totals[name] = int(float(value))
    return tuple(totals[name] for name in SPEC_COUNTERS)


def llama_cpp_server(binary: str, gguf_path: str, max_model_len: int, slots: int, threads: int,
                     name: str = "llama.cpp", extra: Sequence[str] = ()) -> Server:
    """llama.cpp's llama-server with one slot per client; its context is split evenly across the slots.
    `extra`: more flags (its speculation)."""
    port = free_port()
    return Server(name, [binary, "-m", gguf_path, "--port", str(port), "--parallel", str(slots),
                         "--ctx-size", str(max_model_len * slots), "--threads", str(threads),
                         "--threads-batch", str(threads), "--cont-batching", *extra], port)


LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")  # draftless


def llama_spec_flags(spec_type: str, draft_max: int) -> list[str]:
    """llama-server's draftless speculation of one --spec-type, drafting at most `draft_max` tokens a step (the
    n-gram types' own caps too, so every type drafts the same most)."""
    caps = {"ngram-simple": "--spec-ngram-simple-size-m", "ngram-map-k": "--spec-ngram-map-k-size-m",
            "ngram-map-k4v": "--spec-ngram-map-k4v-size-m", "ngram-mod": "--spec-ngram-mod-n-max"}
    flags = ["--spec-type", spec_type, "--spec-draft-n-max", str(draft_max)]
    if spec_type == "ngram-mod":  # its minimum (default 48) must stay at or under the maximum
        flags += ["--spec-ngram-mod-n-min", str(min(draft_max, 48))]
    return flags + ([caps[spec_type], str(draft_max)] if spec_type in caps else [])


class LlamaServerEngine(peer_engines.Engine):
    """llama-server with one slot as a batch-1 (e)/(f) engine: each prompt is one greedy /completion of exactly
    max_tokens tokens (EOS ignored, no prompt-cache reuse), one after another; the server's own draft counts
    are kept (`spec_stats`) as vllmpy's acceptance is."""

    weights = "gguf as stored (quantized blocks)"
    batching = "one sequence at a time (one llama-server slot)"

    def __init__(self, binary: str, gguf_path: str, max_model_len: int, threads: int, spec_type: str,
                 draft_max: int) -> None:
        self.name = f"llama-server {spec_type}"
        self.server = llama_cpp_server(binary, gguf_path, max_model_len, 1, threads, self.name,
                                       llama_spec_flags(spec_type, draft_max))
        version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
        self.version = next((line for line in (version.stdout + version.stderr).splitlines()
                             if line.startswith("version")), "llama-server") + f", --spec-type {spec_type}"
        self.spec_stats = DraftCounts()

    @property
    def pids(self) -> tuple[int, ...]:
        return self.server.pids

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        produced = 0
        start = time.perf_counter()
        for prompt in prompts:
            reply = httpx.post(f"{self.server.base_url}/completion", timeout=3600, json={
                "prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False})
            reply.raise_for_status()
            timings = reply.json()["timings"]
            produced += timings["predicted_n"]
            self.spec_stats.add(timings.get("draft_n", 0), timings.get("draft_n_accepted", 0))
        return time.perf_counter() - start, produced

    def close(self) -> None:
        self.server.stop()


@dataclass
class DraftCounts:
    """llama-server's draft totals in vllmpy's SpecDecodeStats terms; a llama-server reply gives no count of
    drafting steps, so mean acceptance length is unknown (num_drafts stays 0)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted


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
