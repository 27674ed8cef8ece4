"""GGUF for the hybrids llama.cpp names `nemotron_h`, `falcon-h1`, `qwen35`, `qwen35moe`, `qwen3next`, and
for MiniCPM3 (`minicpm3`) and GLM-4.7-Flash (`deepseek2`), each tiny HF checkpoint written as llama.cpp's
converter writes it (conversion/nemotron.py, falcon_h1.py, qwen.py, minicpm.py, glm.py):
  * Nemotron-H: GraniteHybridModel's path: head_count_kv and feed_forward_length per layer (the mixer
    pattern), q/k rows permuted, the Mamba2 mixer's A as -exp(A_log) [H, 1], D [H, 1], conv squeezed,
    norm [groups, I / groups]; llama.cpp floors dt at nothing, so the reference's time_step_min floor is off;
  * Falcon-H1: every muP multiplier folded into the weight it scales (the per-section ssm_multipliers into
    in_proj's rows, key_multiplier into k_proj, ...), so the file's model runs them all at 1;
  * Qwen3.5 / Qwen3.5-MoE: norms stored as 1 + w (not the delta rule's), the value heads tiled for ggml's
    broadcast (v rows of in_proj_qkv and the conv, z, b, a, A, dt_bias, out_proj's columns), the fused
    expert gate_up split, and an MTP block appended (nextn_predict_layers, skipped at load);
  * Qwen3-Next: in_proj_qkvz regrouped into attn_qkv + attn_gate, in_proj_ba kept whole (ssm_ba), no tiling;
  * MiniCPM3: no value_length (llama.cpp's hidden / heads) and its hard-coded scales (12, 1.4, 256);
  * GLM-4.7-Flash: DeepSeek-V2's converter (MLA as MQA, kv_b split) plus its MTP block in block_count.
The projections named in QUANTIZED are Q8_0 (the reference holds those values) and stay packed (Qwen3.5's
out_proj with its columns permuted; Falcon-H1's are F32, as the folded multipliers do not commute with
quantizing); our engine on the file gives the HF model's greedy tokens (strict or near-tie, logprobs 1e-3)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.gate import gate_llm
from tests.gguf.test_gguf_archs import (PROMPTS, _one_thread, _stack_experts, add_vocab, vocab,  # noqa: F401 (fixtures)
                                        write_tensors)
from tests.gguf.test_gguf_deepseek2 import _metadata as deepseek2_metadata
from tests.gguf.test_gguf_deepseek2 import _tensors as deepseek2_tensors
from tests.gguf.test_gguf_hybrid import _ssm_metadata, random_tiny
from tests.gguf.test_gguf_loader import _llama_cpp_permute
from tests.models.test_hybrid_gdn import qwen3_5, qwen3_5_moe, qwen3_next
from tests.models.test_hybrid_mamba import falcon_h1, nemotron_h
from tests.models.test_mla_models import _mla, _moe, minicpm3

MAX_TOKENS = 16
# The Gated DeltaNet families' prompts run in the packed row-dot kernel (float32 x) rather than the 4-32-row
# small-batch kernel, whose int16 activations (error <= 2^-14 of a block's largest |x|, FEATURES.md
# load.gguf-packed) this random-weight delta rule amplifies to logprob errors of 1e-3 - 2e-2 (tokens equal).
GDN_ROW_DOTS = 10 ** 6
Q8_0 = gguf.GGMLQuantizationType.Q8_0
A = gguf.MODEL_ARCH
# HF parameter suffixes rounded through Q8_0 in the reference and written Q8_0: row layouts the converter
# only permutes or splits by rows (so quantizing commutes with it); Falcon-H1's are scaled, so F32 there.
QUANTIZED = ("mixer.in_proj.weight", "mixer.out_proj.weight", "in_proj_qkv.weight", "in_proj_z.weight",
             "in_proj_b.weight", "in_proj_a.weight", "in_proj_qkvz.weight", "in_proj_ba.weight",
             "linear_attn.out_proj.weight", "q_a_proj.weight", "kv_a_proj_with_mqa.weight")


def _qwen(make: Callable[[int], object], **overrides) -> Callable[[int], object]:
    """A Qwen GDN config whose value head (32) is a whole Q8_0 block, so tiling out_proj's columns
    commutes with quantizing it; no dense layers (llama.cpp's Qwen3-Next is sparse everywhere)."""
    def make_config(vocab_size: int):
        config = make(vocab_size)
        config.linear_value_head_dim = 32
        for key, value in overrides.items():
            setattr(config, key, value)
        return config
    return make_config


def _glm47_flash(vocab_size: int):
    """GLM-4.7-Flash as llama.cpp runs a deepseek2 file: DeepSeek-V3's graph (interleaved rope, which
    transformers' Glm4MoeLite does not apply) with its one group, x1.8 and one leading dense layer."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**_mla(vocab_size), **_moe(), q_lora_rank=24, n_group=1, topk_group=1,
                            norm_topk_prob=True, routed_scaling_factor=1.8, rope_interleave=True,
                            tie_word_embeddings=False)


def _minicpm3(vocab_size: int):
    config = minicpm3(vocab_size)
    config.dim_model_base = 256  # llama.cpp's hard-coded values (scale_emb 12 and scale_depth 1.4 as the gate's)
    config.v_head_dim = config.hidden_size // config.num_attention_heads  # llama.cpp's value head
    return config


# name -> (HF config builder, llama.cpp architecture, the architecture our loader states)
CASES: dict[str, tuple[Callable[[int], object], gguf.MODEL_ARCH, str]] = {
    "nemotron_h": (nemotron_h, A.NEMOTRON_H, "NemotronHForCausalLM"),
    "falcon-h1": (falcon_h1, A.FALCON_H1, "FalconH1ForCausalLM"),
    "qwen35": (_qwen(qwen3_5), A.QWEN35, "Qwen3_5ForCausalLM"),
    "qwen35moe": (_qwen(qwen3_5_moe), A.QWEN35MOE, "Qwen3_5MoeForCausalLM"),
    "qwen3next": (_qwen(qwen3_next, mlp_only_layers=[]), A.QWEN3NEXT, "Qwen3_5MoeForCausalLM"),
    "minicpm3": (_minicpm3, A.MINICPM3, "MiniCPM3ForCausalLM"),
    "glm-4.7-flash": (_glm47_flash, A.DEEPSEEK2, "DeepseekV3ForCausalLM"),
}


def _text_model_keys(w: gguf.GGUFWriter, d: dict, blocks: int, context: int, ffn: int | list[int] | None,
                     kv: int | list[int], head_dim: int | None, eps: float, rope: bool = True) -> None:
    """The keys TextModel.set_gguf_parameters (or the family's override) writes for every family here."""
    w.add_embedding_length(d["hidden_size"])
    w.add_head_count(d["num_attention_heads"])
    w.add_vocab_size(d["vocab_size"])
    w.add_block_count(blocks)
    w.add_context_length(context)
    if ffn is not None:
        w.add_feed_forward_length(ffn)
    w.add_head_count_kv(kv)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(eps)
    if rope and "rope_parameters" in d:
        w.add_rope_freq_base(d["rope_parameters"]["rope_theta"])


def _metadata(name: str, w: gguf.GGUFWriter, d: dict) -> None:
    """The keys each converter's set_gguf_parameters writes, for the parts the model uses."""
    if name == "nemotron_h":  # GraniteHybridModel's: no rope (context 2^20), the pattern per layer
        kinds = d["layers_block_type"]
        _text_model_keys(w, d, len(kinds), 2 ** 20, [d["intermediate_size"] if k == "mlp" else 0 for k in kinds],
                         [d["num_key_value_heads"] if k == "full_attention" else 0 for k in kinds], d["head_dim"],
                         d["layer_norm_epsilon"])
        w.add_rope_scaling_finetuned(False)
        _ssm_metadata(w, d["mamba_num_heads"], d["mamba_head_dim"], d["n_groups"], d["ssm_state_size"],
                      d["conv_kernel"])
    elif name == "falcon-h1":
        _text_model_keys(w, d, d["num_hidden_layers"], d["max_position_embeddings"], d["intermediate_size"],
                         d["num_key_value_heads"], d["head_dim"], d["rms_norm_eps"])
        _ssm_metadata(w, d["mamba_n_heads"], d["mamba_d_head"], d["mamba_n_groups"], d["mamba_d_state"],
                      d["mamba_d_conv"])
    elif name == "minicpm3":  # MiniCPM3Model: key_length nope + rope, no value_length
        _text_model_keys(w, d, d["num_hidden_layers"], d["max_position_embeddings"], d["intermediate_size"],
                         d["num_key_value_heads"], None, d["rms_norm_eps"], rope=False)  # llama.cpp's 10000
        w.add_q_lora_rank(d["q_lora_rank"])
        w.add_kv_lora_rank(d["kv_lora_rank"])
        w.add_key_length(d["qk_nope_head_dim"] + d["qk_rope_head_dim"])
        w.add_rope_dimension_count(d["qk_rope_head_dim"])
    else:
        _qwen_metadata(name, w, d)


def _qwen_metadata(name: str, w: gguf.GGUFWriter, d: dict) -> None:
    """Qwen3NextModel's keys (Qwen3.5's converter adds its MTP block and the mrope sections)."""
    mtp = 0 if name == "qwen3next" else 1
    _text_model_keys(w, d, d["num_hidden_layers"] + mtp, d["max_position_embeddings"], d.get("intermediate_size"),
                     d["num_key_value_heads"], d["head_dim"], d["rms_norm_eps"])
    if mtp:
        w.add_nextn_predict_layers(mtp)
        w.add_rope_dimension_sections([11, 11, 10, 0])
    if d.get("num_experts"):
        w.add_expert_count(d["num_experts"])
        w.add_expert_used_count(d["num_experts_per_tok"])
        w.add_expert_feed_forward_length(d["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(d["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(d["linear_conv_kernel_dim"])
    w.add_ssm_state_size(d["linear_key_head_dim"])
    w.add_ssm_group_count(d["linear_num_key_heads"])
    w.add_ssm_time_step_rank(d["linear_num_value_heads"])
    w.add_ssm_inner_size(d["linear_value_head_dim"] * d["linear_num_value_heads"])
    w.add_full_attention_interval(d.get("full_attention_interval") or 4)
    w.add_rope_dimension_count(int(d["head_dim"] * d["rope_parameters"].get("partial_rotary_factor", 0.25)))


def _tile_value_heads(t: torch.Tensor, dim: int, d: dict, width: int) -> torch.Tensor:
    """_LinearAttentionVReorderBase._reorder_v_heads: grouped by key head -> tiled."""
    keys, values = d["linear_num_key_heads"], d["linear_num_value_heads"]
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], keys, values // keys, width, *shape[dim + 1:]).transpose(dim, dim + 1)
    return t.contiguous().reshape(shape)


def _qwen_tensor(name: str, t: torch.Tensor, d: dict, tiled: bool) -> dict[str, torch.Tensor]:
    """Qwen3NextModel.modify_tensors (after the V reorder for Qwen3.5), under names gguf-py maps."""
    qk = 2 * d["linear_num_key_heads"] * d["linear_key_head_dim"]
    v_dim = d["linear_value_head_dim"]
    if tiled and ".linear_attn." in name:
        if "in_proj_qkv" in name:
            t = torch.cat([t[:qk], _tile_value_heads(t[qk:], 0, d, v_dim)])
        elif "in_proj_z" in name:
            t = _tile_value_heads(t, 0, d, v_dim)
        elif "in_proj_b" in name or "in_proj_a" in name or name.endswith((".A_log", ".dt_bias")):
            t = _tile_value_heads(t, 0, d, 1)
        elif "conv1d" in name:
            t = torch.cat([t[:qk], _tile_value_heads(t[qk:], 0, d, v_dim)])
        elif "out_proj" in name:
            t = _tile_value_heads(t, 1, d, v_dim)
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name.replace(".dt_bias", ".dt_proj.bias")
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    if name.endswith("in_proj_qkvz.weight"):
        keys, r = d["linear_num_key_heads"], d["linear_num_value_heads"] // d["linear_num_key_heads"]
        k_dim = d["linear_key_head_dim"]
        q, k, v, z = t.view(keys, -1, t.shape[-1]).split([k_dim, k_dim, r * v_dim, r * v_dim], dim=1)
        flat = [x.reshape(-1, t.shape[-1]) for x in (q, k, v, z)]
        prefix = name.removesuffix("in_proj_qkvz.weight")
        return {prefix + "in_proj_qkv.weight": torch.cat(flat[:3]), prefix + "in_proj_z.weight": flat[3]}
    if name.endswith("mlp.experts.gate_up_proj"):
        gate, up = t.chunk(2, dim=-2)
        base = name.removesuffix("gate_up_proj")
        return {base + "gate_proj.weight": gate, base + "up_proj.weight": up}
    if name.endswith("mlp.experts.down_proj"):
        name += ".weight"
    return {name: t}


def _falcon_tensor(name: str, t: torch.Tensor, d: dict) -> torch.Tensor:
    """FalconH1Model.modify_tensors' multiplier folding."""
    scale = {"down_proj": d["mlp_multipliers"][1], "gate_proj": d["mlp_multipliers"][0],
             "k_proj": d["key_multiplier"] * d["attention_in_multiplier"], "q_proj": d["attention_in_multiplier"],
             "v_proj": d["attention_in_multiplier"], "o_proj": d["attention_out_multiplier"],
             "out_proj": d["ssm_out_multiplier"], "lm_head": d["lm_head_multiplier"],
             "embed_tokens": d["embedding_multiplier"]}
    for key, factor in scale.items():
        if key in name:
            return t * factor
    if "in_proj" in name:
        inner, bc = d["mamba_d_ssm"], d["mamba_n_groups"] * d["mamba_d_state"]
        sizes = [inner, inner, bc, bc, t.shape[0] - 2 * inner - 2 * bc]
        rows = torch.cat([torch.full((size,), m) for size, m in zip(sizes, d["ssm_multipliers"])])
        return t * d["ssm_in_multiplier"] * rows[:, None]
    return t


def _mamba_tensor(name: str, t: torch.Tensor, d: dict, groups: int) -> tuple[str, torch.Tensor]:
    """Mamba2Model.modify_tensors."""
    if name.endswith(".dt_bias"):
        name = name.replace(".dt_bias", ".dt_proj.bias")
    if "conv1d.weight" in name:
        t = t.squeeze(1)
    elif name.endswith((".A_log", ".D")):
        t = t.reshape(-1, 1)
    elif name.endswith(("mixer.norm.weight", "mamba.norm.weight")):
        t = t.reshape(groups, -1)
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    return name, t


def _converted(name: str, state: dict[str, torch.Tensor], d: dict) -> dict[str, torch.Tensor]:
    """The converter's tensor changes, under HF names gguf-py's map knows."""
    out: dict[str, torch.Tensor] = {}
    _stack_experts(state)  # Qwen2MoeModel's merge of the per-expert tensors transformers saves
    for hf, t in state.items():
        if name == "nemotron_h":
            hf = hf.replace("model.embeddings", "backbone.embeddings").replace("model.norm_f", "backbone.norm_f")
            hf = hf.replace("model.layers.", "backbone.layers.")
            if hf.endswith("q_proj.weight"):
                t = torch.from_numpy(_llama_cpp_permute(t.numpy(), d["num_attention_heads"]))
            elif hf.endswith("k_proj.weight"):
                t = torch.from_numpy(_llama_cpp_permute(t.numpy(), d["num_key_value_heads"]))
            out.__setitem__(*_mamba_tensor(hf, t, d, d["n_groups"]))
        elif name == "falcon-h1":
            out.__setitem__(*_mamba_tensor(hf, _falcon_tensor(hf, t, d), d, d["mamba_n_groups"]))
        elif name.startswith("qwen3"):
            out.update(_qwen_tensor(hf, t, d, tiled=name != "qwen3next"))
        else:
            out[hf] = t
    return out


def _mtp_block(tensors: dict[str, np.ndarray], last: int) -> dict[str, np.ndarray]:
    """The MTP block the converter appends after the decoder: the last layer's tensors renumbered plus the
    nextn ones (any values: the loader skips the block)."""
    block = {n.replace(f"blk.{last}.", f"blk.{last + 1}.", 1): a for n, a in tensors.items()
             if n.startswith(f"blk.{last}.")}
    hidden = tensors["token_embd.weight"].shape[1]
    block[f"blk.{last + 1}.nextn.eh_proj.weight"] = np.zeros((hidden, 2 * hidden), np.float32)
    block[f"blk.{last + 1}.nextn.enorm.weight"] = np.ones(hidden, np.float32)
    return block


def _file_tensors(name: str, model, arch: gguf.MODEL_ARCH) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file

    d = model.config.to_dict()
    if name == "glm-4.7-flash":
        tensors = deepseek2_tensors(load_file(model.hf_dir / "model.safetensors"), model.config, split=True)
        return {**tensors, **_mtp_block(tensors, d["num_hidden_layers"] - 1)}
    layers = len(d.get("layers_block_type") or []) or d["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, layers + 1)
    tensors = {}
    for hf, t in _converted(name, load_file(model.hf_dir / "model.safetensors"), d).items():
        mapped = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert mapped is not None, f"gguf-py has no llama.cpp name for {hf}"
        if hf.endswith((".weight", ".bias")) and not mapped.endswith((".weight", ".bias")):
            mapped += hf[hf.rindex("."):]  # gguf-py maps a few names with their suffix included
        tensors[mapped] = t.float().contiguous().numpy()
    if name in ("qwen35", "qwen35moe"):
        tensors.update(_mtp_block(tensors, layers - 1))
    return tensors


def _write(name: str, vocab: dict, out: Path):
    make_config, arch, _ = CASES[name]
    config = make_config(len(vocab["tokenizer.ggml.tokens"]))
    model = random_tiny(config, QUANTIZED if name != "falcon-h1" else ())
    with torch.no_grad():
        for buffer_name, b in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    for module in model.modules():  # llama.cpp floors Nemotron-H's dt at nothing (transformers: time_step_min)
        if hasattr(module, "time_step_limit") and name == "nemotron_h":
            module.time_step_limit = (0.0, float("inf"))
    model.save_pretrained(out / "hf")
    model.hf_dir = out / "hf"
    path = out / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    if name == "glm-4.7-flash":
        deepseek2_metadata(w, config, split=True)
        w.add_block_count(config.num_hidden_layers + 1)
        w.add_nextn_predict_layers(1)
    else:
        _metadata(name, w, config.to_dict())
    add_vocab(w, vocab)
    quantized = ("ssm_in.weight", "ssm_out.weight", "attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight",
                 "ssm_alpha.weight", "ssm_ba.weight", "attn_q_a.weight", "attn_kv_a_mqa.weight")
    q8 = name != "falcon-h1"
    write_tensors(w, _file_tensors(name, model, arch),
                  lambda mapped, _: Q8_0 if q8 and mapped.endswith(quantized) and "nextn" not in mapped else None)
    return model, path


@pytest.mark.parametrize("name", list(CASES))
def test_recurrent_and_mla_gguf_greedy_matches_transformers(name, vocab, tmp_path, monkeypatch):
    from vllmpy import LLM

    if name.startswith("qwen3"):  # see GDN_ROW_DOTS
        monkeypatch.setattr("vllmpy.layers.quantized.SMALL_MIN_ROWS", GDN_ROW_DOTS)
    reference, path = _write(name, vocab, tmp_path)
    llm = LLM(model=str(path), dtype="float32", num_blocks=32, block_size=16, max_model_len=256)
    config = llm.engine.core.checkpoint.config
    assert config["architectures"] == [CASES[name][2]]
    model = llm.engine.core.runner.model
    if name != "falcon-h1":  # its projections are F32 (the folded multipliers); the rest Q8_0, packed
        packed = [m for m in model.modules() if getattr(m, "packed", None) is not None]
        assert packed, "no projection stayed packed"
    if name.startswith("qwen35"):  # out_proj computes on the file's tiled columns
        outs = [m.out_proj for m in model.modules() if hasattr(m, "in_proj") and hasattr(m, "A_log")]
        assert outs and all(o.packed is not None and o.packed.input_perm is not None for o in outs)
    result = gate_llm(llm, reference, PROMPTS, MAX_TOKENS, f"gguf {name}")
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == len(PROMPTS)


def test_value_heads_that_do_not_group_under_the_key_heads_are_refused_by_name():
    from vllmpy.errors import UnsupportedCheckpointError
    from vllmpy.loader.gguf.transforms import UninterleaveBetaAlpha, UntileValueHeads

    config = {"linear_num_key_heads": 3, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
              "linear_value_head_dim": 32}
    with pytest.raises(UnsupportedCheckpointError, match="blk.0.ssm_beta.weight.*linear_num_value_heads 4.*3"):
        UntileValueHeads(0, "one").check("blk.0.ssm_beta.weight", (4, 64), config)
    with pytest.raises(UnsupportedCheckpointError, match="blk.0.ssm_ba.weight.*2 \\* linear_num_value_heads = 8"):
        UninterleaveBetaAlpha().check("blk.0.ssm_ba.weight", (6, 64), {**config, "linear_num_key_heads": 2})
