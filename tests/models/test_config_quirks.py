"""Config spellings the tiny gate configs (saved by transformers 5) do not produce, read as transformers
reads them; models built on the meta device, no weights."""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from vllmpy.errors import UnsupportedCheckpointError

BASE = {"vocab_size": 32, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}


def _build(cls, config):
    with torch.device("meta"):
        return cls(config)


def test_gemma_legacy_gelu_means_tanh():
    from vllmpy.models.gemma import GemmaForCausalLM

    act = _build(GemmaForCausalLM, {**BASE, "hidden_act": "gelu", "head_dim": 16}).model.layers[0].mlp.act
    x = torch.linspace(-3, 3, 7)
    assert torch.equal(act(x), F.gelu(x, approximate="tanh"))


def test_phi3_su_rope_scaling_is_longrope():
    from vllmpy.models.phi3 import Phi3ForCausalLM

    config = {**BASE, "max_position_embeddings": 1024, "original_max_position_embeddings": 64,
              "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}}
    rotary = _build(Phi3ForCausalLM, config).model.rotary["full_attention"]
    base = 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    assert torch.allclose(rotary.inv_freq, 1 / (4.0 * base))  # serving 1024 > 64: the long factors
    assert rotary.attention_scaling == pytest.approx((1 + math.log(16) / math.log(64)) ** 0.5)  # factor 1024 / 64


def test_olmo3_classic_rope_scaling_applies_to_global_layers_only():
    from vllmpy.models.olmo2 import Olmo3ForCausalLM

    config = {**BASE, "sliding_window": 8, "rope_theta": 10000.0,
              "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    rotary = _build(Olmo3ForCausalLM, config).model.rotary
    assert torch.allclose(rotary["full_attention"].inv_freq * 4, rotary["sliding_attention"].inv_freq)


def test_internlm3_refuses_different_bias_switches():
    from vllmpy.models.internlm3 import InternLM3ForCausalLM

    with pytest.raises(UnsupportedCheckpointError, match="qkv_bias=True but bias=False"):
        _build(InternLM3ForCausalLM, {**BASE, "qkv_bias": True, "bias": False})
    model = _build(InternLM3ForCausalLM, {**BASE, "qkv_bias": True, "bias": True})
    layer = model.model.layers[0]
    assert layer.self_attn.o_proj.bias is not None and layer.mlp.down_proj.bias is not None


def test_gpt2_config_names():
    from vllmpy.models.gpt2 import GPT2LMHeadModel

    model = _build(GPT2LMHeadModel, {"vocab_size": 32, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128})
    specs = model.kv_cache_specs(16, torch.float32)
    assert [(type(s).__name__, s.num_kv_heads, s.head_dim) for s in specs] == [("FullAttentionSpec", 4, 16)] * 2
    assert model.model.embed_positions.num_embeddings == 128
    assert model.model.layers[0].mlp.fc1.weight.shape == (256, 64)  # n_inner unset: 4 * n_embd
