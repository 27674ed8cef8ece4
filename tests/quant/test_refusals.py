"""Unsupported quantization variants are refused by field and value, and a config naming modules the
checkpoint lacks by module, all before any weight is read (reading one fails these tests)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from vllmpy.config import ModelConfig
from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.loader.model_loader import open_checkpoint

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 32}
CT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                               "strategy": "group", "group_size": 32}}


def _ct(**overrides) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": CT_GROUP},
            **overrides}


def _ct_weights(**weights) -> dict:
    return _ct(config_groups={"g": {**CT_GROUP, "weights": {**CT_GROUP["weights"], **weights}}})


@pytest.fixture(autouse=True)
def no_weight_reads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read before the refusal")
    monkeypatch.setattr("vllmpy.loader.quantization.weights.read_tensor", refuse)


def _open(tmp_path, quant: dict, tensors: dict[str, torch.Tensor] | None = None):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "quantization_config": quant}))
    if tensors is not None:
        save_file(tensors, str(tmp_path / "model.safetensors"))
    return open_checkpoint(ModelConfig(model=str(tmp_path)))


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "quark"}, r"quant_method='quark'.*supported: gptq, awq, fp8, compressed-tensors, mxfp4"),
    ({"quant_method": "gptq", "bits": 3}, r"bits=3.*supported: 4, 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, r"group_size=16.*multiple of 32"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, r"checkpoint_format='marlin'"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*": {}}}, r"dynamic="),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"version='gemv'.*gemm"),
    ({"quant_method": "awq", "bits": 8}, r"bits=8.*supported: 4"),
    ({"quant_method": "awq", "zero_point": False}, r"zero_point=False"),
    ({"quant_method": "fp8", "activation_scheme": "per_tensor"}, r"activation_scheme='per_tensor'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 48]}, r"weight_block_size=\[128, 48\]"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, r"fmt='e5m2'"),
    (_ct(format="nvfp4-pack-quantized"), r"config_groups.g.format='nvfp4-pack-quantized'"),
    (_ct(kv_cache_scheme={"num_bits": 8}), r"kv_cache_scheme="),
    (_ct(config_groups={}), r"config_groups=\{\}"),
    (_ct_weights(num_bits=2), r"num_bits=2.*supported: 4, 8"),
    (_ct_weights(strategy="tensor"), r"strategy='tensor'.*group, channel"),
    (_ct_weights(group_size=48), r"group_size=48"),
    (_ct_weights(type="float"), r"type='float'.*int"),
    (_ct_weights(group_size=None), r"group_size=None.*strategy group"),
    (_ct(config_groups={"g": {**CT_GROUP, "input_activations": {"num_bits": 4, "type": "int"}}}), r"num_bits=4"),
])
def test_unsupported_field_is_named(tmp_path, quant, message):
    with pytest.raises(UnsupportedCheckpointError, match=message):
        _open(tmp_path, quant)  # not even a weight file: refused from config.json alone


def _dense_llama() -> dict[str, torch.Tensor]:
    return {"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64),
            "model.layers.0.input_layernorm.weight": torch.zeros(64)}


def test_ignored_module_the_checkpoint_lacks_is_named(tmp_path):
    with pytest.raises(UnsupportedCheckpointError, match="ignores module 'model.layers.7.mlp'"):
        _open(tmp_path, _ct(ignore=["model.layers.7.mlp"]), _dense_llama())


def test_ignored_lm_head_of_a_tied_checkpoint_is_accepted(tmp_path):
    """llm-compressor lists lm_head in `ignore` even where tied embeddings mean the file stores none."""
    from vllmpy.loader.quantization import QuantizedSafetensors, parse_quantization_config

    save_file(_dense_llama(), str(tmp_path / "model.safetensors"))
    weights = QuantizedSafetensors(str(tmp_path), parse_quantization_config(_ct(ignore=["lm_head"])))
    assert list(weights.plan) == ["model.layers.0.self_attn.q_proj"]


def test_targets_matching_no_module_are_named(tmp_path):
    group = {**CT_GROUP, "targets": ["re:.*experts.*"]}
    with pytest.raises(UnsupportedCheckpointError, match=r"targets \['re:.\*experts.\*'\] match no module"):
        _open(tmp_path, _ct(config_groups={"g": group}), _dense_llama())


def test_gptq_config_without_quantized_tensors_is_refused(tmp_path):
    with pytest.raises(UnsupportedCheckpointError, match="no tensor of the checkpoint is stored quantized"):
        _open(tmp_path, {"quant_method": "gptq", "bits": 4, "group_size": 32}, _dense_llama())


def test_scales_disagreeing_with_group_size_are_named():
    from tests.quant import reference as ref
    from vllmpy.loader.quantization.config import GPTQ, Scheme
    from vllmpy.loader.quantization.formats import read_module

    q, zeros, scales = ref.quantize(torch.randn(64, 128), 4, 64, sym=True)
    tensors = {f"m.{k}": v for k, v in ref.gptq_tensors(q, zeros, scales, 4, None, v1=True).items()}
    with pytest.raises(UnsupportedCheckpointError, match=r"'m.scales' has 2 groups.*group_size=32 means 4"):
        read_module("m", Scheme(GPTQ, bits=4, group_size=32), tensors.__getitem__, tensors.__contains__)


def test_quantized_tensor_of_an_unquantized_module_is_named(tmp_path):
    tensors = {**_dense_llama(), "model.layers.0.mlp.down_proj.qweight": torch.zeros(16, 64, dtype=torch.int32),
               "model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 64, dtype=torch.int8)}
    with pytest.raises(UnsupportedCheckpointError, match="o_proj.weight.*I8.*leaves its module unquantized"):
        _open(tmp_path, {"quant_method": "gptq", "bits": 4, "group_size": 32, "modules_in_block_to_quantize": None},
              tensors)
