"""GGUF for the dense families beyond llama / qwen / gemma3.

Each tiny HF checkpoint is written as llama.cpp's converter writes it: tensor names from gguf-py's own
name map, the converter's value changes (Gemma's norm + 1, Granite's q/k row permutation, GPT-2's
Conv1D transpose, StableLM's stacked per-head norms, Phi-3's LongRoPE factor tensors, the MoE families'
experts merged into one [E, out, in] tensor per projection) and its metadata
keys, with SmolLM2's GGUF vocabulary. Then
  * our engine on that file gives the HF model's greedy tokens (the gate's strict / near-tie rule);
  * where transformers reads the architecture from GGUF, its model of the same file holds the original
    weights, which checks the writer here against an implementation that is not ours.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH

from tests.gate import gate_llm
from tests.gguf.test_gguf_loader import _llama_cpp_permute

PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5,"]
MAX_TOKENS = 16
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                   "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                   "tokenizer.ggml.eos_token_id")


def _configs(vocab: int) -> dict:
    """Tiny configs llama.cpp can represent (e.g. Gemma 2's query scale is 1/sqrt(head_dim) there)."""
    from transformers import (
        Cohere2Config,
        CohereConfig,
        Gemma2Config,
        GemmaConfig,
        Glm4Config,
        GPT2Config,
        GraniteConfig,
        GraniteMoeConfig,
        MixtralConfig,
        Olmo2Config,
        Olmo3Config,
        OlmoeConfig,
        Phi3Config,
        PhiConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
        SmolLM3Config,
        StableLmConfig,
    )

    base = {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": 1,
            "eos_token_id": 2}
    rms = {**base, "rms_norm_eps": 1e-6}
    ln = {**base, "layer_norm_eps": 1e-5}
    return {
        "gemma": GemmaConfig(**{**rms, "num_key_value_heads": 1}, head_dim=32),
        "gemma2": Gemma2Config(**{**rms, "num_hidden_layers": 4}, head_dim=32, query_pre_attn_scalar=32,
                               sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=10.0),
        # llama.cpp's phi2 states head_count_kv = head_count and feed_forward_length = 4 * hidden.
        "phi2": PhiConfig(**{**ln, "num_key_value_heads": 4, "intermediate_size": 256}, partial_rotary_factor=0.5),
        "phi3": Phi3Config(**rms, partial_rotary_factor=0.75, sliding_window=16, original_max_position_embeddings=4,
                           rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                         "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 12.0]}),
        # transformers reads GPT-2's context_length as n_ctx and keeps the default n_positions (1024)
        "gpt2": GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=1024, bos_token_id=1,
                           eos_token_id=2),
        "stablelm": StableLmConfig(**ln, partial_rotary_factor=0.25, use_qkv_bias=True, qk_layernorm=True),
        # transformers' GGUF reader knows neither flag, nor stacked per-head norms: its read-back case
        "stablelm-plain": StableLmConfig(**ln, partial_rotary_factor=0.25),
        "olmo2": Olmo2Config(**rms),
        "olmo3": Olmo3Config(**{**rms, "num_hidden_layers": 4}, sliding_window=8),
        "granite": GraniteConfig(**rms, embedding_multiplier=12.0, attention_multiplier=0.1,
                                 residual_multiplier=0.22, logits_scaling=8.0),
        # 4 layers: layer 3 is NoPE, as llama.cpp hard-codes it
        "smollm3": SmolLM3Config(**{**rms, "num_hidden_layers": 4}, pad_token_id=0),
        # its converter writes rms eps 1e-5 whatever the config says, and no clip_qkv
        "olmoe": OlmoeConfig(**{**base, "intermediate_size": 32, "rms_norm_eps": 1e-5}, num_experts=8,
                             num_experts_per_tok=3),
        "granitemoe": GraniteMoeConfig(**{**rms, "intermediate_size": 32}, num_local_experts=8, num_experts_per_tok=2,
                                       embedding_multiplier=12.0, attention_multiplier=0.1, residual_multiplier=0.22,
                                       logits_scaling=8.0),
        "command-r": CohereConfig(**ln, use_qk_norm=True, logit_scale=0.5),
        "cohere2": Cohere2Config(**{**ln, "num_hidden_layers": 4}, sliding_window=8, logit_scale=0.5),
        "glm4": Glm4Config(**rms, head_dim=32, pad_token_id=0),
        # llama.cpp writes Mixtral as `llama` with experts; it renormalizes qwen3moe's top-k, not qwen2moe's.
        "mixtral": MixtralConfig(**rms, num_local_experts=8, num_experts_per_tok=2),
        "qwen2moe": Qwen2MoeConfig(**rms, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=96),
        # older converters squeezed the [1, hidden] shared-expert gate to [hidden]
        "qwen2moe-squeezed": Qwen2MoeConfig(**rms, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=96),
        "qwen3moe": Qwen3MoeConfig(**rms, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                   norm_topk_prob=True),
    }


GGUF_ARCH = {"gemma": MODEL_ARCH.GEMMA, "gemma2": MODEL_ARCH.GEMMA2, "phi2": MODEL_ARCH.PHI2, "phi3": MODEL_ARCH.PHI3,
             "gpt2": MODEL_ARCH.GPT2, "stablelm": MODEL_ARCH.STABLELM,
             "stablelm-plain": MODEL_ARCH.STABLELM, "olmo2": MODEL_ARCH.OLMO2,
             "olmo3": MODEL_ARCH.OLMO2, "granite": MODEL_ARCH.GRANITE, "granitemoe": MODEL_ARCH.GRANITE_MOE,
             "olmoe": MODEL_ARCH.OLMOE, "smollm3": MODEL_ARCH.SMOLLM3, "command-r": MODEL_ARCH.COMMAND_R,
             "cohere2": MODEL_ARCH.COHERE2, "glm4": MODEL_ARCH.GLM4, "mixtral": MODEL_ARCH.LLAMA,
             "qwen2moe": MODEL_ARCH.QWEN2MOE, "qwen2moe-squeezed": MODEL_ARCH.QWEN2MOE,
             "qwen3moe": MODEL_ARCH.QWEN3MOE}
TRANSFORMERS_READS = ["gemma2", "phi3", "gpt2", "stablelm-plain"]  # archs transformers loads from GGUF


def _metadata(name: str, w: gguf.GGUFWriter, c) -> None:
    """The keys each llama.cpp converter writes (set_gguf_parameters), for the parts the model uses."""
    d = c.to_dict()
    if name == "gpt2":
        w.add_block_count(d["n_layer"])
        w.add_context_length(d["n_positions"])
        w.add_embedding_length(d["n_embd"])
        w.add_feed_forward_length(4 * d["n_embd"])
        w.add_head_count(d["n_head"])
        w.add_layer_norm_eps(d["layer_norm_epsilon"])
        return
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    head_dim = d.get("head_dim") or hidden // heads
    rope = d.get("rope_parameters") or {}
    w.add_context_length(d["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(d["num_hidden_layers"])
    w.add_feed_forward_length(4 * hidden if name == "phi2" else d["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(heads if name == "phi2" else d["num_key_value_heads"])
    if "rms_norm_eps" in d:
        w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    if "layer_norm_eps" in d:
        w.add_layer_norm_eps(d["layer_norm_eps"])
    if name not in ("gemma", "gemma2", "stablelm", "stablelm-plain", "phi2"):  # those converters write no rope base
        w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if name in ("gemma", "gemma2", "glm4"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if name in ("phi2", "phi3", "stablelm", "stablelm-plain", "cohere2", "glm4", "granite", "granitemoe", "mixtral",
                "smollm3"):
        partial = rope.get("partial_rotary_factor", 0.5 if name == "glm4" else 1.0)
        w.add_rope_dimension_count(int(head_dim * partial))
    if name == "gemma2":
        w.add_attn_logit_softcapping(d["attn_logit_softcapping"])
        w.add_final_logit_softcapping(d["final_logit_softcapping"])
    if name in ("gemma2", "phi3", "cohere2", "olmo3"):
        w.add_sliding_window(d["sliding_window"])
    if name == "olmo3":
        w.add_sliding_window_pattern([t == "sliding_attention" for t in d["layer_types"]])
    if name == "phi3":
        original = rope["original_max_position_embeddings"]
        scale = d["max_position_embeddings"] / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
    if name.startswith("stablelm"):
        w.add_parallel_residual(d["use_parallel_residual"])
    if name in ("command-r", "cohere2"):
        w.add_logit_scale(d["logit_scale"])
    if name.startswith(("mixtral", "qwen2moe", "qwen3moe", "granitemoe", "olmoe")):
        w.add_expert_count(d.get("num_local_experts") or d["num_experts"])
        w.add_expert_used_count(d["num_experts_per_tok"])
    if name.startswith(("qwen2moe", "qwen3moe")):
        w.add_expert_feed_forward_length(d["moe_intermediate_size"])
    if name.startswith("qwen2moe"):
        w.add_expert_shared_feed_forward_length(d["shared_expert_intermediate_size"])
    if name.startswith("granite"):
        w.add_attention_scale(d["attention_multiplier"])
        w.add_embedding_scale(d["embedding_multiplier"])
        w.add_residual_scale(d["residual_multiplier"])
        w.add_logit_scale(d["logits_scaling"])


def _tensors(name: str, state: dict[str, torch.Tensor], c) -> dict[str, np.ndarray]:
    """HF tensors under llama.cpp names, with the converter's value changes (modify_tensors)."""
    d = c.to_dict()
    layers = d.get("num_hidden_layers", d.get("n_layer"))
    names = gguf.get_tensor_name_map(GGUF_ARCH[name], layers)
    out = {}
    if name == "stablelm":  # one [heads, head_dim] tensor from the per-head norms
        for i in range(layers):
            for qk in "qk":
                prefix = f"model.layers.{i}.self_attn.{qk}_layernorm.norms."
                rows = sorted((k for k in state if k.startswith(prefix)),
                              key=lambda k: int(k[len(prefix):].split(".")[0]))
                state[f"model.layers.{i}.self_attn.{qk}_layernorm.weight"] = torch.stack([state.pop(k) for k in rows])
    _stack_experts(state)
    for key in [k for k in state if k.endswith(".block_sparse_moe.input_linear.weight")]:  # Granite-MoE: split
        gate, up = state.pop(key).chunk(2, dim=1)
        prefix = key.removesuffix("block_sparse_moe.input_linear.weight")
        state[f"{prefix}mlp.experts.gate_proj.weight"], state[f"{prefix}mlp.experts.up_proj.weight"] = gate, up
    for hf, tensor in state.items():
        if name in ("gemma", "gemma2") and hf == "lm_head.weight":
            continue
        if name in ("gemma", "gemma2") and hf.endswith("norm.weight"):
            tensor = tensor + 1
        if name in ("granite", "granitemoe", "mixtral", "smollm3") and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = d["num_attention_heads"] if "q_proj" in hf else d["num_key_value_heads"]
            tensor = torch.from_numpy(_llama_cpp_permute(tensor.numpy(), heads))
        if name == "gpt2" and hf.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            tensor = tensor.t()
        if name == "qwen2moe-squeezed" and hf.endswith(".shared_expert_gate.weight"):
            tensor = tensor.squeeze(0)
        mapped = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert mapped is not None, f"gguf-py has no llama.cpp name for {hf}"
        out[mapped] = np.ascontiguousarray(tensor.float().numpy())
    if name == "phi3":
        rope = d["rope_parameters"]
        out["rope_factors_long.weight"] = np.array(rope["long_factor"], np.float32)
        out["rope_factors_short.weight"] = np.array(rope["short_factor"], np.float32)
    return out


def _stack_experts(state: dict[str, torch.Tensor]) -> None:
    """The MoE converters' merge: each projection of every expert into one [E, out, in] tensor
    (`...experts.3.w1.weight` -> `...experts.w1.weight`)."""
    per_expert = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)\.weight")
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for key in [k for k in state if per_expert.fullmatch(k)]:
        match = per_expert.fullmatch(key)
        stacks.setdefault(f"{match[1]}.{match[3]}.weight", {})[int(match[2])] = state.pop(key)
    for key, experts in stacks.items():
        state[key] = torch.stack([experts[e] for e in sorted(experts)])


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread (see tests/models/conftest.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def vocab(smollm2_gguf_path) -> dict:
    reader = gguf.GGUFReader(smollm2_gguf_path)
    return {key: reader.fields[key].contents() for key in _TOKENIZER_KEYS}


def add_vocab(w: gguf.GGUFWriter, vocab: dict) -> None:
    """SmolLM2's GGUF vocabulary (`vocab`: its tokenizer metadata keys) into the file being written."""
    w.add_tokenizer_model(vocab["tokenizer.ggml.model"])
    w.add_tokenizer_pre(vocab["tokenizer.ggml.pre"])
    w.add_token_list(vocab["tokenizer.ggml.tokens"])
    w.add_token_types(vocab["tokenizer.ggml.token_type"])
    w.add_token_merges(vocab["tokenizer.ggml.merges"])
    w.add_bos_token_id(vocab["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(vocab["tokenizer.ggml.eos_token_id"])


def write_tensors(w: gguf.GGUFWriter, tensors: dict[str, np.ndarray],
                  quantized_as: Callable[[str, np.ndarray], gguf.GGMLQuantizationType | None] = lambda *_: None) -> None:
    """Add every tensor, quantized to the GGML type `quantized_as(name, data)` names (None: as it is), and write
    the file out as gguf-py's writer does."""
    for name, data in tensors.items():
        qtype = quantized_as(name, data)
        if qtype is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write(name: str, model, out: Path, vocab: dict, expert_type: gguf.GGMLQuantizationType | None = None) -> Path:
    """expert_type: the MoE expert stacks (`ffn_*_exps`) quantized to that GGML type, the rest float32."""
    from safetensors.torch import load_file

    config = model.config
    path = out / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[GGUF_ARCH[name]])
    _metadata(name, w, config)
    add_vocab(w, vocab)
    tensors = _tensors(name, load_file(out / "hf" / "model.safetensors"), config)
    write_tensors(w, tensors, lambda tensor_name, _: expert_type if "_exps." in tensor_name else None)
    return path


def _tiny(name: str, vocab: dict, out: Path, expert_type: gguf.GGMLQuantizationType | None = None):
    from transformers import AutoModelForCausalLM

    config = _configs(len(vocab["tokenizer.ggml.tokens"]))[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            is_norm = "norm" in param_name or ".ln_" in param_name
            p.normal_(0.0, 0.3 if p.dim() == 1 or is_norm else 0.15)
            if is_norm and param_name.endswith("weight") and name not in ("gemma", "gemma2"):
                p.add_(1.0)
    model.save_pretrained(out / "hf")
    return model, _write(name, model, out, vocab, expert_type)


@pytest.mark.parametrize("name", sorted(GGUF_ARCH))
def test_gguf_greedy_matches_transformers(name, vocab, tmp_path):
    from vllmpy import LLM

    reference, path = _tiny(name, vocab, tmp_path)
    llm = LLM(model=str(path), dtype="float32", num_blocks=32, block_size=16, max_model_len=256)
    assert llm.engine.core.checkpoint.config["architectures"] == reference.config.architectures
    result = gate_llm(llm, reference, PROMPTS, MAX_TOKENS, f"gguf {name}")
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == len(PROMPTS)


@pytest.mark.parametrize("name", TRANSFORMERS_READS)
def test_transformers_reads_the_written_file_back(name, vocab, tmp_path):
    """The writer above is llama.cpp's layout as transformers understands it: same weights back."""
    from transformers import AutoModelForCausalLM

    reference, path = _tiny(name, vocab, tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    expected, loaded = reference.state_dict(), theirs.state_dict()
    for key, tensor in expected.items():
        assert key in loaded, f"transformers did not load {key} from the GGUF"
        assert torch.allclose(loaded[key], tensor, atol=1e-6), key
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
        assert getattr(theirs.config, key) == getattr(reference.config, key), key
