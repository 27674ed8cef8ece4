"""A checkpoint we cannot serve is refused at load, by name, before any weight is loaded."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.loader.safetensors import SafetensorsWeights

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 32}


def _write_dir(path, config=LLAMA):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_unknown_architecture_lists_supported(tmp_path):
    from vllmpy.models.registry import resolve_model_class

    with pytest.raises(UnsupportedCheckpointError) as err:
        resolve_model_class({**LLAMA, "architectures": ["FancyNetForCausalLM"]})
    message = str(err.value)
    assert "FancyNetForCausalLM" in message and "LlamaForCausalLM" in message and "Gemma3ForCausalLM" in message


def test_unknown_architecture_refused_by_llm(tmp_path):
    from vllmpy import LLM

    _write_dir(tmp_path, {**LLAMA, "architectures": ["FancyNetForCausalLM"]})
    with pytest.raises(UnsupportedCheckpointError, match="FancyNetForCausalLM"):
        LLM(model=str(tmp_path))


def test_truncated_safetensors_is_named(tmp_path):
    _write_dir(tmp_path)
    file = tmp_path / "model.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(32, 8)}, str(file))
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    with pytest.raises(UnsupportedCheckpointError, match="truncated") as err:
        SafetensorsWeights(str(tmp_path))
    assert "model.safetensors" in str(err.value)


def test_missing_shard_is_named(tmp_path):
    _write_dir(tmp_path)
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedCheckpointError, match="model-00002-of-00002.safetensors"):
        SafetensorsWeights(str(tmp_path))


def test_unsupported_dtype_names_tensor(tmp_path):
    _write_dir(tmp_path)
    save_file({"model.layers.0.mlp.down_proj.weight": torch.zeros(8, 16, dtype=torch.int8)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedCheckpointError, match=r"down_proj.weight.*I8"):
        SafetensorsWeights(str(tmp_path))


def test_unsupported_quant_method_is_refused_by_name(tmp_path):
    from vllmpy.config import ModelConfig
    from vllmpy.loader.model_loader import open_checkpoint

    _write_dir(tmp_path, {**LLAMA, "quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(UnsupportedCheckpointError, match="quant_method='bitsandbytes'.*gptq, awq"):
        open_checkpoint(ModelConfig(model=str(tmp_path)))


def test_missing_and_unexpected_tensors_are_named():
    from vllmpy.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LLAMA)
    model = model.to_empty(device="cpu")
    with pytest.raises(UnsupportedCheckpointError, match="no tensor for parameter"):
        model.load_weights([])
    with pytest.raises(UnsupportedCheckpointError, match="model.layers.0.mystery.weight"):
        model.load_weights([("model.layers.0.mystery.weight", torch.zeros(1))])


def test_missing_model_path_is_named():
    from vllmpy.config import ModelConfig
    from vllmpy.loader.model_loader import open_checkpoint

    with pytest.raises(FileNotFoundError, match="/no/such/dir"):
        open_checkpoint(ModelConfig(model="/no/such/dir"))
    assert not os.path.exists("/no/such/dir")
