"""Adapters we cannot serve are refused by name when a request first names them; the engine goes on."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.lora.adapters import AdapterSpec, edit_config, make_adapter
from tests.tiny_models import make_tiny_checkpoint
from vllmpy import LLM, LoRARequest, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=2)


@pytest.fixture(scope="module")
def setup(smollm2_tokenizer_dir, tmp_path_factory) -> tuple[LLM, Path, Path]:
    out = tmp_path_factory.mktemp("lora_refusals")
    base = make_tiny_checkpoint("LlamaForCausalLM", smollm2_tokenizer_dir, out / "base")
    make_adapter(base, out / "good", AdapterSpec(8, 16, ("q_proj", "v_proj")), seed=1)
    make_adapter(base, out / "rank16", AdapterSpec(16, 16, ("o_proj",)), seed=2)
    llm = LLM(model=str(out / "base"), dtype="float32", enable_lora=True, max_lora_rank=8, num_blocks=32,
              max_model_len=128)
    return llm, out, out / "good"


def _variant(good: Path, out: Path, name: str) -> Path:
    path = out / name
    if path.exists():
        shutil.rmtree(path)
    shutil.copytree(good, path)
    return path


def _generate(llm: LLM, path: Path, lora_id: int) -> None:
    llm.generate(["Hello"], PARAMS, use_tqdm=False, lora_request=LoRARequest(path.name, lora_id, str(path)))


@pytest.mark.parametrize("name, change, message", [
    ("bin", "bin", "adapter_model.bin is a pickle"),
    ("save", {"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ("unknown", {"target_modules": ["q_proj", "foo_proj"]}, "target module 'foo_proj' is not a linear layer"),
    ("embed", {"target_modules": ["embed_tokens"]}, "target module 'embed_tokens' is an embedding"),
    ("dora", {"use_dora": True}, "use_dora (DoRA) is not supported"),
    ("bias", {"bias": "all"}, "bias 'all' is not supported"),
    ("prompt", {"peft_type": "PROMPT_TUNING"}, "peft_type 'PROMPT_TUNING' is not supported"),
])
def test_refused_by_name(setup, name, change, message):
    llm, out, good = setup
    path = _variant(good, out, name)
    if change == "bin":
        (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")  # never unpickled
    else:
        edit_config(path, **change)
    with pytest.raises(ValueError, match=f"LoRA adapter '{name}'.*{re.escape(message)}"):
        _generate(llm, path, 100)
    _generate(llm, good, 1)  # the engine still serves


def test_rank_above_max_lora_rank(setup):
    llm, out, _ = setup
    with pytest.raises(ValueError, match=r"rank r=16 is above --max-lora-rank 8"):
        _generate(llm, out / "rank16", 2)


def test_missing_directory(setup, tmp_path):
    llm, _, _ = setup
    with pytest.raises(ValueError, match="is not a directory"):
        _generate(llm, tmp_path / "nowhere", 3)


def test_lora_not_enabled(tiny_llama_dir, setup):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="LoRA is not enabled; start the engine with --enable-lora"):
        _generate(llm, setup[2], 1)


@pytest.mark.parametrize("args, message", [
    ({"max_lora_rank": 7}, "--max-lora-rank must be one of 1, 8, 16"),
    ({"max_loras": 0}, "--max-loras must be >= 1"),
    ({"max_loras": 4, "max_cpu_loras": 2}, r"--max-cpu-loras \(2\) must be >= --max-loras \(4\)"),
    ({"tensor_parallel_size": 2}, "--enable-lora with --tensor-parallel-size 2 is not supported"),
])
def test_flag_ranges(args, message):
    with pytest.raises(ValueError, match=message):
        LLM(model="unused", enable_lora=True, **args)
