"""GGUF for the Mamba2 families (`mamba2`, `granitehybrid`: Granite 4.0-H MoE / dense, Bamba) and `lfm2`,
written as llama.cpp's converter writes them (Mamba2Model / GraniteHybridModel / LFM2Model): head_count 0
and a 2^20 context for Mamba2, head_count_kv per layer (0 on recurrent layers), rope.scaling.finetuned as
the rope switch, the mixer's A stored as -exp(A_log) [H, 1], D as [H, 1], the conv squeezed to [C, K],
the gated norm as [groups, I / groups], dt_bias as ssm_dt.bias, q/k rows permuted for llama.cpp's rope
(Granite), the experts' input_linear split into gate / up stacks and the shared MLP into gate / up;
LFM2's short conv squeezed to [C, K] and its MLP's built width as feed_forward_length; the recurrent
mixers' projections in Q8_0. Our engine on the file gives the HF model's greedy tokens (strict or
near-tie), with those projections kept packed."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch

from tests.gate import gate_llm
from tests.gguf.test_gguf_archs import PROMPTS, _one_thread, add_vocab, vocab, write_tensors  # noqa: F401 (fixtures)
from tests.gguf.test_gguf_loader import _llama_cpp_permute
from tests.models.test_hybrid_gdn import lfm2
from tests.models.test_hybrid_mamba import bamba, granite_hybrid, granite_hybrid_dense, mamba2
from vllmpy.models.granite_hybrid import mamba_layers

MAX_TOKENS = 16
Q8_0 = gguf.GGMLQuantizationType.Q8_0
# name -> (HF config builder, gguf-py architecture)
CASES: dict[str, tuple[Callable[[int], object], gguf.MODEL_ARCH]] = {
    "mamba2": (mamba2, gguf.MODEL_ARCH.MAMBA2),
    "granitehybrid-moe": (granite_hybrid, gguf.MODEL_ARCH.GRANITE_HYBRID),
    "granitehybrid-dense": (granite_hybrid_dense, gguf.MODEL_ARCH.GRANITE_HYBRID),
    "bamba": (bamba, gguf.MODEL_ARCH.GRANITE_HYBRID),
    "lfm2": (lfm2, gguf.MODEL_ARCH.LFM2),
}
# the recurrent mixers' projections, written in Q8_0
QUANTIZED = ("ssm_in.weight", "ssm_out.weight", "shortconv.in_proj.weight", "shortconv.out_proj.weight")


def _ssm_metadata(w: gguf.GGUFWriter, heads: int, head_dim: int, groups: int, state: int, conv: int) -> None:
    w.add_ssm_conv_kernel(conv)
    w.add_ssm_state_size(state)
    w.add_ssm_group_count(groups)
    w.add_ssm_inner_size(heads * head_dim)
    w.add_ssm_time_step_rank(heads)  # llama.cpp's name for the SSM head count


def _lfm2_metadata(w: gguf.GGUFWriter, model) -> None:
    """LFM2Model: head_count_kv per layer, the MLP's built width as feed_forward_length."""
    d = model.config.to_dict()
    w.add_context_length(d["max_position_embeddings"])
    w.add_feed_forward_length(model.model.layers[0].feed_forward.w1.weight.shape[0])
    w.add_head_count(d["num_attention_heads"])
    w.add_head_count_kv([d["num_key_value_heads"] if t == "full_attention" else 0 for t in d["layer_types"]])
    w.add_rope_freq_base(d["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(d["norm_eps"])
    w.add_shortconv_l_cache(d["conv_L_cache"])
    w.add_vocab_size(d["vocab_size"])


def _metadata(w: gguf.GGUFWriter, model, arch: gguf.MODEL_ARCH) -> None:
    d = model.config.to_dict()
    w.add_embedding_length(d["hidden_size"])
    w.add_block_count(d["num_hidden_layers"])
    if arch == gguf.MODEL_ARCH.LFM2:
        _lfm2_metadata(w, model)
        return
    if arch == gguf.MODEL_ARCH.MAMBA2:
        w.add_context_length(2 ** 20)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        _ssm_metadata(w, d["num_heads"], d["head_dim"], d["n_groups"], d["state_size"], d["conv_kernel"])
        w.add_layer_norm_rms_eps(d["layer_norm_epsilon"])
        return
    mamba = mamba_layers(d)
    bamba_like = d["model_type"] == "bamba"
    w.add_context_length(d["max_position_embeddings"] if bamba_like else 2 ** 20)
    w.add_feed_forward_length(d["intermediate_size"])
    w.add_head_count(d["num_attention_heads"])
    w.add_head_count_kv([0 if m else d["num_key_value_heads"] for m in mamba])
    w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    w.add_rope_freq_base(d["rope_parameters"]["rope_theta"])
    head_dim = d["hidden_size"] // d["num_attention_heads"]
    w.add_rope_dimension_count(head_dim // 2 if bamba_like else head_dim)
    w.add_rope_scaling_finetuned(bamba_like or d.get("position_embedding_type") == "rope")
    for key, add in (("embedding_multiplier", w.add_embedding_scale), ("residual_multiplier", w.add_residual_scale),
                     ("attention_multiplier", w.add_attention_scale), ("logits_scaling", w.add_logit_scale)):
        if key in d:
            add(d[key])
    if d.get("num_local_experts"):
        w.add_expert_count(d["num_local_experts"])
        w.add_expert_used_count(d["num_experts_per_tok"])
    if d.get("shared_intermediate_size"):
        w.add_expert_shared_feed_forward_length(d["shared_intermediate_size"])
    _ssm_metadata(w, d["mamba_n_heads"], d["mamba_d_head"], d["mamba_n_groups"], d["mamba_d_state"], d["mamba_d_conv"])


def _converted(state: dict[str, torch.Tensor], c) -> dict[str, torch.Tensor]:
    """The converter's tensor changes, under HF names gguf-py's map knows."""
    d = c.to_dict()
    permute = d["model_type"] != "lfm2"  # GraniteHybridModel's undo_permute; LFM2Model keeps HF's rows
    experts = bool(d.get("num_local_experts"))
    groups = d.get("n_groups") or d.get("mamba_n_groups")
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        name = name.replace(".dt_bias", ".dt_proj.bias")
        if name.endswith(".A_log"):
            t = -torch.exp(t).reshape(-1, 1)
        elif name.endswith(".D"):
            t = t.reshape(-1, 1)
        elif name.endswith(("conv1d.weight", "conv.conv.weight")):
            t = t.squeeze(1)
        elif name.endswith(("mixer.norm.weight", "mamba.norm.weight")):
            t = t.reshape(groups, -1)
        elif name.endswith("q_proj.weight") and permute:
            t = torch.from_numpy(_llama_cpp_permute(t.numpy(), d["num_attention_heads"]))
        elif name.endswith("k_proj.weight") and permute:
            t = torch.from_numpy(_llama_cpp_permute(t.numpy(), d["num_key_value_heads"]))
        if name.endswith("block_sparse_moe.input_linear.weight"):
            gate, up = t.chunk(2, dim=-2)
            experts_at = name.removesuffix("block_sparse_moe.input_linear.weight") + "mlp.experts."
            out[experts_at + "gate_proj.weight"], out[experts_at + "up_proj.weight"] = gate, up
        elif name.endswith("shared_mlp.input_linear.weight"):
            gate, up = t.chunk(2, dim=-2)
            mlp = name.removesuffix("shared_mlp.input_linear.weight") + ("mlp.shared_expert." if experts else "mlp.")
            out[mlp + "gate_proj.weight"], out[mlp + "up_proj.weight"] = gate, up
        elif name.endswith("shared_mlp.output_linear.weight"):
            down = "mlp.shared_expert.down_proj" if experts else "mlp.down_proj"
            out[name.replace("shared_mlp.output_linear", down)] = t
        else:
            out[name] = t
    return out


def random_tiny(config, quantized: tuple[str, ...]):
    """The HF model of `config` with seeded weights a tiny hybrid computes stably on (norms near 1; A_log,
    dt_bias and D in [-1, 1]); the parameters whose names end in `quantized` hold their Q8_0 values, as
    the file will, so the reference computes what the file holds."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.normal_(1.0, 0.3)
            elif param_name.endswith(("A_log", "dt_bias", ".D")):
                p.uniform_(-1.0, 1.0)
            else:
                p.normal_(0.0, 0.3 if p.dim() == 1 else 0.15)
            if param_name.endswith(quantized):
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), Q8_0), Q8_0)))
    return model


def _write(name: str, vocab: dict, out: Path):
    from safetensors.torch import load_file

    make_config, arch = CASES[name]
    config = make_config(len(vocab["tokenizer.ggml.tokens"]))
    model = random_tiny(config, ("in_proj.weight", "out_proj.weight"))
    model.save_pretrained(out / "hf")
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    path = out / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(w, model, arch)
    add_vocab(w, vocab)
    tensors = {}
    for hf, tensor in _converted(load_file(out / "hf" / "model.safetensors"), config).items():
        mapped = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert mapped is not None, f"gguf-py has no llama.cpp name for {hf}"
        tensors[mapped] = tensor.float().contiguous().numpy()
    write_tensors(w, tensors, lambda mapped, _: Q8_0 if mapped.endswith(QUANTIZED) else None)
    return model, path


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_gguf_greedy_matches_transformers(name, vocab, tmp_path):
    from vllmpy import LLM

    reference, path = _write(name, vocab, tmp_path)
    llm = LLM(model=str(path), dtype="float32", num_blocks=32, block_size=16, max_model_len=256)
    expected = {"mamba2": "Mamba2ForCausalLM", "lfm2": "Lfm2ForCausalLM"}.get(name, "GraniteMoeHybridForCausalLM")
    assert llm.engine.core.checkpoint.config["architectures"] == [expected]
    mixers = [m for m in llm.engine.core.runner.model.modules() if hasattr(m, "recurrent_state_spec")]
    assert mixers and all(m.in_proj.packed is not None and m.out_proj.packed is not None for m in mixers)
    result = gate_llm(llm, reference, PROMPTS, MAX_TOKENS, f"gguf {name}")
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == len(PROMPTS)
