"""vllm-cli: completion on stdout, the seed's two timing lines per run on stderr, every flag in --help."""
from __future__ import annotations

import re
import subprocess
import sys

RUN_LINE = re.compile(r"^vllm-cli: run=(\d+)/(\d+) finish_reason=(\w+) prompt_tokens=(\d+) completion_tokens=(\d+) "
                      r"secs=\d+\.\d{3} tok_s=\d+\.\d{3}$")
TIME_LINE = re.compile(r"^vllm-cli: run=(\d+)/(\d+) generate_start_unix=(\d+\.\d{6}) generate_end_unix=(\d+\.\d{6})$")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllmpy.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_repeat_prints_seed_format(tiny_llama_dir):
    result = _cli("--model", tiny_llama_dir, "--prompt", "The capital of France is", "--max-tokens", "6",
                  "--temperature", "0", "--ignore-eos", "--repeat", "3", "--num-blocks", "32")
    assert result.returncode == 0, result.stderr
    runs = [RUN_LINE.match(line) for line in result.stderr.splitlines() if RUN_LINE.match(line)]
    times = [TIME_LINE.match(line) for line in result.stderr.splitlines() if TIME_LINE.match(line)]
    assert [(m[1], m[2]) for m in runs] == [("1", "3"), ("2", "3"), ("3", "3")]
    assert all(m[3] == "length" and m[5] == "6" for m in runs)
    assert [(m[1], m[2]) for m in times] == [("1", "3"), ("2", "3"), ("3", "3")]
    assert all(float(m[3]) <= float(m[4]) for m in times)
    texts = result.stdout.splitlines()
    assert len(texts) >= 3 and len(set(texts)) == 1  # greedy: the same completion every run


def test_help_lists_every_flag():
    result = _cli("--help")
    assert result.returncode == 0
    for flag in ("--model", "--prompt", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--dtype",
                 "--device", "--repeat", "--max-model-len", "--block-size", "--num-blocks", "--kv-cache-memory",
                 "--enable-prefix-caching", "--no-enable-prefix-caching", "--max-num-seqs",
                 "--max-num-batched-tokens", "--scheduling-policy", "--revision", "--download-dir"):
        assert flag in result.stdout, flag


def test_bad_model_is_a_clear_error():
    result = _cli("--model", "/no/such/model", "--prompt", "x")
    assert result.returncode == 2
    assert "vllm-cli: error:" in result.stderr and "/no/such/model" in result.stderr
    assert "Traceback" not in result.stderr
