"""`--model org/repo` resolves through a Hugging Face cache laid out by the test, offline."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _lay_out_cache(hf_home, source_dir: str, repo: str = "tiny-org/tiny-llama") -> str:
    repo_dir = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / COMMIT
    shutil.copytree(source_dir, snapshot)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(COMMIT)
    return str(snapshot)


def _run(code: str, hf_home) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_repo_id_resolves_from_cache_offline(tiny_llama_dir, tmp_path):
    snapshot = _lay_out_cache(tmp_path, tiny_llama_dir)
    code = ("from vllmpy.loader.hub import resolve_repo; "
            f"print(resolve_repo('tiny-org/tiny-llama')); print(resolve_repo('tiny-org/tiny-llama', revision='{COMMIT}'))")
    result = _run(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [snapshot, snapshot]


def test_llm_generates_from_repo_id(tiny_llama_dir, tmp_path):
    _lay_out_cache(tmp_path, tiny_llama_dir)
    code = ("from vllmpy import LLM, SamplingParams; llm = LLM('tiny-org/tiny-llama', num_blocks=32); "
            "print(len(llm.generate(['Hi'], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids))")
    result = _run(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("4")


def test_missing_repo_is_named(tmp_path):
    result = _run("from vllmpy.loader.hub import resolve_repo; resolve_repo('nobody/nothing')", tmp_path)
    assert result.returncode != 0
    assert "nobody/nothing" in result.stderr and "not found in the Hugging Face cache" in result.stderr


def test_download_dir_is_the_cache(tiny_llama_dir, tmp_path):
    cache = tmp_path / "elsewhere"
    snapshot = _lay_out_cache(cache, tiny_llama_dir)
    code = f"from vllmpy.loader.hub import resolve_repo; print(resolve_repo('tiny-org/tiny-llama', download_dir='{cache / 'hub'}'))"
    result = _run(code, tmp_path / "empty_home")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == snapshot
