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


def test_start_imports_only_what_it_runs():
    """vllm-cli starts its tokenizer prefetch before torch is imported, and its engine never imports the server,
    a chat template renderer, transformers or the compilers' symbolic math."""
    code = ("import sys, vllmpy.entrypoints.cli as cli; before = 'torch' in sys.modules; import vllmpy.entrypoints.llm;"
            " print(before, sorted({'fastapi', 'uvicorn', 'starlette', 'pydantic', 'jinja2', 'transformers', 'ray',"
            " 'sympy', 'huggingface_hub'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False []"


def test_default_model_peak_rss():
    """Peak RSS of a warm start on the default model (Gemma 3 270M Q4_K_M) stays under 650 MB (587-598 measured,
    690 before the tokenizer cache was parsed by `tokenizers` itself and the copied file pages released)."""
    from vllmpy.loader.default_model import default_model_path
    from vllmpy.loader.gguf.file import read_gguf
    from vllmpy.tokenizer import gguf_cache

    args = ["--prompt", "Hello there", "--max-tokens", "8", "--num-blocks", "64", "--max-model-len", "1024"]
    key = gguf_cache.metadata_key(read_gguf(default_model_path())[0])
    if not gguf_cache._entry_paths(key)[1].exists():  # a cold start builds the tokenizer cache first
        assert _cli(*args).returncode == 0
    # A fresh parent whose only child is the cli, so RUSAGE_CHILDREN's peak is that run's (as /usr/bin/time's).
    parent = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
              "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    result = subprocess.run([sys.executable, "-c", parent, sys.executable, "-m", "vllmpy.entrypoints.cli", *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    peak_mb = int(result.stdout) / 1024
    assert peak_mb <= 650, f"peak RSS {peak_mb:.0f} MB"
