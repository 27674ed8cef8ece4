"""vllm-bench smoke runs on the tiny random Llama: the report's fields and their consistency, not its speed."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import pytest

from vllmpy.entrypoints.bench.prompts import load_jsonl
from vllmpy.entrypoints.bench.serve import NOT_REPORTED, info_header

# One intra-op thread: on a shared machine, oversubscribed OpenMP threads make a tiny model 100x slower.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ENGINE_HEADER = ("vllmpy version", "Model", "Weight format", "Dtype", "Device", "Threads", "Max num seqs",
                 "Block size", "KV blocks", "KV cache dtype (requested)", "KV cache dtype (resolved storage)")


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllmpy.entrypoints.bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, check=False)


def _report(result: subprocess.CompletedProcess, path) -> dict:
    assert result.returncode == 0, result.stderr
    report = json.loads(path.read_text())
    for label, value in report["header"].items():  # stdout carries the same header, one aligned line each
        assert re.search(rf"^{re.escape(label)}:\s+{re.escape(value)}$", result.stdout, re.MULTILINE), label
    return report


def _check_engine_header(header: dict, model: str) -> None:
    assert set(ENGINE_HEADER) <= set(header)
    assert re.fullmatch(r"\d+\.\d+\.\d+ \(commit \S+.*\)", header["vllmpy version"])
    assert header["Model"] == model
    assert header["Weight format"] == "safetensors float32, loaded as float32"
    assert (header["Dtype"], header["Device"], header["Block size"], header["KV blocks"]) == \
        ("float32", "cpu", "16", "64")
    assert header["Threads"].startswith("1 (OMP_NUM_THREADS=1")
    assert header["KV cache dtype (requested)"] == "auto"
    assert header["KV cache dtype (resolved storage)"] == "float32 (4-byte pages)"


def test_throughput_report(tiny_llama_dir, tmp_path):
    out = tmp_path / "throughput.json"
    report = _report(_bench("throughput", "--model", tiny_llama_dir, "--num-prompts", "4", "--input-len", "8",
                            "--output-len", "3", "--num-blocks", "64", "--output-json", str(out)), out)
    _check_engine_header(report["header"], tiny_llama_dir)
    r = report["results"]
    assert (r["num_requests"], r["total_input_tokens"], r["total_output_tokens"]) == (4, 32, 12)
    assert r["requests_per_s"] > 0
    assert r["output_tok_per_s"] == pytest.approx(12 / r["elapsed_s"])
    assert report["args"]["num_prompts"] == 4


def test_latency_report(tiny_llama_dir, tmp_path):
    out = tmp_path / "latency.json"
    report = _report(_bench("latency", "--model", tiny_llama_dir, "--batch-size", "2", "--input-len", "8",
                            "--output-len", "4", "--num-iters-warmup", "0", "--num-iters", "2",
                            "--num-blocks", "64", "--output-json", str(out)), out)
    _check_engine_header(report["header"], tiny_llama_dir)
    r = report["results"]
    assert (r["batches"], r["requests"]) == (2, 4)
    for name in ("ttft_ms", "tpot_ms", "e2e_latency_s"):
        assert 0 < r[f"{name}_p50"] <= r[f"{name}_p99"], name
    assert r["decode_tok_per_s"] > 0 and r["prefill_tok_per_s"] > 0


def test_serve_report(tiny_llama_dir, tmp_path):
    from tests.server.conftest import ServerProcess

    server = ServerProcess("--model", tiny_llama_dir, "--num-blocks", "64", "--max-model-len", "256", env=ENV)
    try:
        out = tmp_path / "serve.json"
        report = _report(_bench("serve", "--base-url", server.url.removesuffix("/v1"), "--num-prompts", "6",
                                "--input-len", "8", "--output-len", "4", "--max-concurrency", "3",
                                "--output-json", str(out)), out)
        metrics = httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=30).text
    finally:
        server.stop()
    header, r = report["header"], report["results"]
    _check_engine_header(header, tiny_llama_dir)  # the server's own configuration, read from its /metrics
    assert header["vllmpy version"].endswith(" (client)")
    assert header["Server version"] == header["vllmpy version"].split()[0]
    for info in (r'vllm:cache_config_info\{.*block_size="16".*num_gpu_blocks="64"',
                 r'vllmpy:engine_config_info\{.*device="cpu",dtype="float32"'):
        assert re.search(rf"^{info}.*\}} 1\.0$", metrics, re.MULTILINE), info
    assert (r["completed"], r["errors"], r["total_input_tokens"], r["total_output_tokens"]) == (6, 0, 48, 24)
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert 0 < r[f"{name}_p50"] <= r[f"{name}_p90"] <= r[f"{name}_p99"], name
    assert report["args"]["request_rate"] == "inf"


def test_serve_header_from_a_vllm_server():
    """vLLM exports only vllm:cache_config_info (its own label set): those lines are read, the rest say so."""
    text = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
            'gpu_memory_utilization="0.9",num_gpu_blocks="4096"} 1.0\n'
            'python_info{implementation="CPython",version="3.12"} 1.0\n')
    header = info_header(text)
    assert (header["Block size"], header["KV blocks"], header["KV cache dtype (requested)"],
            header["Prefix caching"]) == ("16", "4096", "auto", "True")
    assert header["Dtype"] == header["Weight format"] == header["KV cache dtype (resolved storage)"] == NOT_REPORTED
    assert set(info_header("").values()) == {NOT_REPORTED}


def test_unreachable_server_is_a_clear_error():
    result = _bench("serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1", timeout=60)
    assert result.returncode == 2
    assert "vllm-bench: error:" in result.stderr and "127.0.0.1:9" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_flag_refused_before_loading():
    result = _bench("throughput", "--model", "/no/such/model", "--num-prompts", "0", timeout=60)
    assert result.returncode == 2 and "--num-prompts must be >= 1, got 0" in result.stderr


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello"}\n\n{"prompt_token_ids": [1, 2, 3]}\n{"prompt": "x"}\n')
    assert load_jsonl(str(path), limit=2) == [{"prompt": "Hello"}, {"prompt_token_ids": [1, 2, 3]}]
    path.write_text('{"text": "Hello"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:1: expected"):
        load_jsonl(str(path))
