"""GGUF for the 2025-26 families: `exaone4`, `seed_oss`, `ernie4_5-moe`, `glm4moe`, `llama4`, `gpt-oss`.

Each tiny random HF checkpoint (test_moe_families' configs, or one llama.cpp can represent) is written
as llama.cpp's converter writes it: gguf-py's tensor names, transformers' fused expert stacks split
into ffn_gate_exps / ffn_up_exps [E, I, H] (Llama 4's [E, H, 2I] transposed), the correction bias as
exp_probs_b.bias, GLM-4.5's MTP block counted in block_count, and the metadata keys its
set_gguf_parameters writes. Our engine on the file must give exactly the greedy tokens of our engine
on the safetensors checkpoint; Q8_0 and MXFP4 expert stacks stay packed.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH

from tests.gguf.test_gguf_archs import PROMPTS, _one_thread, add_vocab, vocab, write_tensors  # noqa: F401 (fixtures)
from tests.models import test_moe_families as families
from tests.models.test_batch_invariance import _agree, _outputs
from tests.tiny_models import make_tiny_checkpoint

LLM_ARGS = {"dtype": "float32", "num_blocks": 32, "block_size": 16, "max_model_len": 256}


def llama4(vocab_size: int):
    """Llama 4 with what llama.cpp hard-codes (chunks of 8192, NoPE every 4th layer, floor scale 8192)."""
    from transformers import Llama4TextConfig

    return Llama4TextConfig(**{**families._base(vocab_size), "intermediate_size": 32}, head_dim=16,
                            intermediate_size_mlp=128, num_local_experts=8, num_experts_per_tok=2,
                            interleave_moe_layer_step=2, attention_chunk_size=8192, no_rope_layer_interval=4,
                            use_qk_norm=True, attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
                            tie_word_embeddings=False)


def gpt_oss(vocab_size: int):
    """gpt-oss with llama.cpp's hard-coded SwiGLU limit (7) and the family's untruncated YaRN."""
    from transformers import GptOssConfig

    return GptOssConfig(**{**families._base(vocab_size), "intermediate_size": 32}, head_dim=32, num_local_experts=8,
                        num_experts_per_tok=2, sliding_window=8, attention_bias=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                         "original_max_position_embeddings": 64})


# GGUF architecture -> (HF architecture, tiny config, gguf-py arch)
FAMILIES: dict[str, tuple[str, Callable[[int], object], MODEL_ARCH]] = {
    "exaone4": ("Exaone4ForCausalLM", families.exaone4, MODEL_ARCH.EXAONE4),
    "seed_oss": ("SeedOssForCausalLM", families.seed_oss, MODEL_ARCH.SEED_OSS),
    "ernie4_5-moe": ("Ernie4_5_MoeForCausalLM", families.ernie45_moe, MODEL_ARCH.ERNIE4_5_MOE),
    "glm4moe": ("Glm4MoeForCausalLM", families.glm4_moe, MODEL_ARCH.GLM4_MOE),
    "llama4": ("Llama4ForCausalLM", llama4, MODEL_ARCH.LLAMA4),
    "gpt-oss": ("GptOssForCausalLM", gpt_oss, MODEL_ARCH.GPT_OSS),
}


# arch -> the HF keys of its expert count, experts per token and expert width
EXPERT_KEYS = {"ernie4_5-moe": ("moe_num_experts", "moe_k", "moe_intermediate_size"),
               "glm4moe": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"),
               "llama4": ("num_local_experts", "num_experts_per_tok", "intermediate_size"),
               "gpt-oss": ("num_local_experts", "num_experts_per_tok", "intermediate_size")}


def _metadata(arch: str, w: gguf.GGUFWriter, d: dict) -> int:
    """The keys the converter's set_gguf_parameters writes; returns block_count (GLM's MTP layers included)."""
    heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // heads
    blocks = d["num_hidden_layers"] + (d.get("num_nextn_predict_layers") or 0 if arch == "glm4moe" else 0)
    w.add_context_length(d["max_position_embeddings"])
    w.add_embedding_length(d["hidden_size"])
    w.add_block_count(blocks)
    w.add_feed_forward_length(d["intermediate_size_mlp"] if arch == "llama4" else d["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(d["num_key_value_heads"])
    w.add_rope_freq_base(d["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    w.add_key_length(head_dim)  # TextModel writes head_dim when the config has one
    w.add_value_length(head_dim)
    if arch == "exaone4":
        w.add_sliding_window(d["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in d["layer_types"]])
    if arch in EXPERT_KEYS:
        count, used, width = EXPERT_KEYS[arch]
        w.add_expert_count(d[count])
        w.add_expert_used_count(d[used])
        w.add_expert_feed_forward_length(d[width])
    if arch == "ernie4_5-moe":
        w.add_interleave_moe_layer_step(d["moe_layer_interval"])
        w.add_leading_dense_block_count(d["moe_layer_start_index"])
        w.add_expert_shared_count(d["moe_num_shared_experts"])
    if arch == "glm4moe":
        w.add_rope_dimension_count(int(head_dim * d.get("partial_rotary_factor", 0.5)))
        w.add_expert_group_count(d["n_group"])
        w.add_expert_group_used_count(d["topk_group"])
        w.add_expert_shared_count(d["n_shared_experts"])
        w.add_leading_dense_block_count(d["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(d["routed_scaling_factor"])
        w.add_expert_weights_norm(d["norm_topk_prob"])
        w.add_nextn_predict_layers(blocks - d["num_hidden_layers"])
    if arch == "llama4":
        w.add_rope_dimension_count(head_dim)
        w.add_interleave_moe_layer_step(d["interleave_moe_layer_step"])
    if arch == "gpt-oss":
        rope = d["rope_parameters"]
        w.add_sliding_window(d["sliding_window"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    return blocks


def _split_gate_up(fused: torch.Tensor, dim: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """gate | up halves along dim, or alternating rows (gpt-oss)."""
    if interleaved:
        return fused.index_select(dim, torch.arange(0, fused.shape[dim], 2)), \
            fused.index_select(dim, torch.arange(1, fused.shape[dim], 2))
    return fused.chunk(2, dim=dim)


def _converter_state(state: dict[str, torch.Tensor], tied: bool, arch: str) -> dict[str, torch.Tensor]:
    """transformers' tensors under their published names as modify_tensors leaves them before naming: fused
    experts split into gate and up stacks [E, I, H] (Llama 4's and gpt-oss's [E, in, out] stacks transposed
    first, gpt-oss's rows and biases interleaved), the correction bias renamed to a `.bias`, gpt-oss's sinks
    given a `.weight`, no lm_head when tied."""
    in_out, interleaved = arch in ("llama4", "gpt-oss"), arch == "gpt-oss"
    out = {}
    for name, tensor in state.items():
        name = (name.replace(".feed_forward.", ".mlp.").replace(".gate.moe_statics.", ".moe_statics.")  # as published
                .replace("e_score_correction_bias", "e_score_correction.bias"))
        if tied and name == "lm_head.weight":
            continue
        if name.endswith("_bias") and ".experts." in name:  # gpt-oss's [E, out] expert biases
            stem, proj = name.removesuffix("_bias").rsplit(".", 1)
            if proj == "down_proj":
                out[f"{stem}.down_proj.bias"] = tensor
            else:
                out[f"{stem}.gate_proj.bias"], out[f"{stem}.up_proj.bias"] = _split_gate_up(tensor, 1, interleaved)
            continue
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            tensor = tensor.transpose(1, 2) if in_out else tensor
            stem, proj = name.rsplit(".", 1)
            if proj == "down_proj":
                out[f"{stem}.down_proj.weight"] = tensor
            else:
                out[f"{stem}.gate_proj.weight"], out[f"{stem}.up_proj.weight"] = _split_gate_up(tensor, 1, interleaved)
            continue
        out[f"{name}.weight" if name.endswith(".sinks") else name] = tensor
    return out


def _write(arch: str, model, path: Path, vocab: dict, expert_type: gguf.GGMLQuantizationType | None = None) -> Path:
    """expert_type: the expert weight stacks quantized to that GGML type, the rest (their biases too) float32."""
    _, _, gguf_arch = FAMILIES[arch]
    d = model.config.to_dict()
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf_arch])
    blocks = _metadata(arch, w, d)
    add_vocab(w, vocab)
    names = gguf.get_tensor_name_map(gguf_arch, blocks)
    state = _converter_state(model.state_dict(), bool(d.get("tie_word_embeddings")), arch)
    tensors = {}
    for hf, tensor in state.items():
        mapped = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert mapped is not None, f"gguf-py has no llama.cpp name for {hf}"
        tensors[mapped] = np.ascontiguousarray(tensor.float().numpy())
    rng = np.random.default_rng(0)
    for layer in range(d["num_hidden_layers"], blocks):  # GLM's MTP block: written, not loaded
        tensors[f"blk.{layer}.nextn.eh_proj.weight"] = rng.normal(size=(64, 128)).astype(np.float32)
        tensors[f"blk.{layer}.attn_norm.weight"] = np.ones(64, np.float32)
    write_tensors(w, tensors, lambda mapped, _: expert_type if mapped.endswith("_exps.weight") else None)
    return path


def _checkpoint(arch: str, tokenizer_dir: str, vocab: dict, out: Path, **write_args):
    """The safetensors checkpoint (with the tokenizer) and its GGUF conversion."""
    hf_arch, make_config, _ = FAMILIES[arch]
    model = make_tiny_checkpoint(hf_arch, tokenizer_dir, out / "hf", make_config)
    return out / "hf", _write(arch, model, out / f"{arch}.gguf", vocab, **write_args)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_gguf_greedy_equals_safetensors(arch, vocab, smollm2_tokenizer_dir, tmp_path):
    from vllmpy import LLM

    hf_dir, path = _checkpoint(arch, smollm2_tokenizer_dir, vocab, tmp_path)
    ours = LLM(model=str(path), **LLM_ARGS)
    reference = LLM(model=str(hf_dir), **LLM_ARGS)
    config = ours.engine.core.checkpoint.config
    assert config["architectures"] == [FAMILIES[arch][0]]
    assert config["num_hidden_layers"] == families._base(0)["num_hidden_layers"]  # GLM's MTP block left out
    expected, got = _outputs(reference, PROMPTS), _outputs(ours, PROMPTS)
    for prompt, (want, _), (have, _) in zip(PROMPTS, expected, got):
        assert list(have) == list(want), f"gguf {arch} {prompt!r}: {list(have)} vs safetensors {list(want)}"


@pytest.mark.parametrize(("arch", "expert_type"), [("glm4moe", gguf.GGMLQuantizationType.Q8_0),
                                                   ("gpt-oss", gguf.GGMLQuantizationType.MXFP4)],
                         ids=["glm4moe-Q8_0", "gpt-oss-MXFP4"])
def test_quantized_expert_stacks_stay_packed(arch, expert_type, vocab, smollm2_tokenizer_dir, tmp_path, monkeypatch):
    """Q8_0 (GLM-4.5) and MXFP4 (gpt-oss, as its converter writes the experts) stacks compute on the
    file's blocks, with the tokens of the same file dequantized at load (VLLMPY_GGUF_KEEP_QUANT=0)."""
    from vllmpy import LLM
    from vllmpy.layers.moe import ExpertLinear

    _, path = _checkpoint(arch, smollm2_tokenizer_dir, vocab, tmp_path, expert_type=expert_type)
    packed = LLM(model=str(path), **LLM_ARGS)
    stacks = [m for m in packed.engine.core.runner.model.modules() if isinstance(m, ExpertLinear)]
    assert stacks and all(m.packed is not None and m.weight.numel() == 0 for m in stacks)
    kept = _outputs(packed, PROMPTS)
    monkeypatch.setenv("VLLMPY_GGUF_KEEP_QUANT", "0")
    dense = LLM(model=str(path), **LLM_ARGS)
    assert all(m.packed is None for m in dense.engine.core.runner.model.modules() if isinstance(m, ExpertLinear))
    _agree(_outputs(dense, PROMPTS), kept, f"{arch} packed {expert_type.name} experts vs dequantized")


def test_glm4moe_refuses_a_gating_it_does_not_route_by():
    from vllmpy.errors import UnsupportedCheckpointError
    from vllmpy.loader.gguf.archs import ARCHS
    from vllmpy.loader.gguf.metadata import ArchMetadata

    meta = ArchMetadata({"glm4moe.expert_gating_func": 1}, "glm4moe")
    with pytest.raises(UnsupportedCheckpointError, match=r"glm4moe\.expert_gating_func=1 .*supported: 2 \(sigmoid\)"):
        ARCHS["glm4moe"].extra_config(meta, {"num_hidden_layers": 4, "head_dim": 32}, {})


def test_llama4_without_a_window_has_no_chunks():
    """llama.cpp's MobileLLM-style llama4 files state sliding_window 0: full attention, only the last layer NoPE."""
    from vllmpy.loader.gguf.archs import ARCHS
    from vllmpy.loader.gguf.metadata import ArchMetadata

    keys = {"expert_count": 8, "expert_used_count": 1, "expert_feed_forward_length": 32,
            "attention.sliding_window": 0}
    meta = ArchMetadata({f"llama4.{k}": v for k, v in keys.items()}, "llama4")
    extra = ARCHS["llama4"].extra_config(meta, {"num_hidden_layers": 6, "intermediate_size": 128}, {})
    assert extra["layer_types"] == ["full_attention"] * 6
    assert extra["no_rope_layers"] == [1, 1, 1, 1, 1, 0]
    assert (extra["intermediate_size"], extra["intermediate_size_mlp"], extra["use_qk_norm"]) == (32, 128, True)


def _ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """openai's codes [..., nb, 16] (values 2j, 2j + 1 in byte j) and scales [..., nb] as the converter's
    repack writes them: GGML MXFP4 rows [..., nb * 17], the scale byte then values j, j + 16 in byte j."""
    values = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2)
    nibbles = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), nibbles], dim=-1).flatten(-2).numpy()


def _write_from_mxfp4(model, tensors: dict[str, torch.Tensor], path: Path, vocab: dict, fused: bool) -> None:
    """The converter on an MXFP4 gpt-oss checkpoint (`tensors` as on disk): each `<proj>_blocks` / `_scales`
    pair repacked, not dequantized, into an MXFP4 stack (gate_up's rows split even / odd into ffn_gate_exps
    / ffn_up_exps, or with `--fuse-gate-up-exps` one ffn_gate_up_exps of gate rows then up rows, biases
    alike), everything else float32 as `--outtype f32` writes it; the vocabulary under o200k's
    pre-tokenizer name, as gpt-oss's is."""
    d = model.config.to_dict()
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[MODEL_ARCH.GPT_OSS])
    blocks = _metadata("gpt-oss", w, d)
    add_vocab(w, {**vocab, "tokenizer.ggml.pre": "gpt-4o"})
    names = gguf.get_tensor_name_map(MODEL_ARCH.GPT_OSS, blocks)
    dense = {k: v for k, v in tensors.items() if not k.endswith(("_blocks", "_scales"))}
    floats = {names.get_name(hf, try_suffixes=(".weight", ".bias")): np.ascontiguousarray(tensor.float().numpy())
              for hf, tensor in _converter_state(dense, bool(d.get("tie_word_embeddings")), "gpt-oss").items()}
    stacks = {}
    for stem in sorted({k.removesuffix("_blocks") for k in tensors if k.endswith("_blocks")}):
        codes, scales = tensors[f"{stem}_blocks"], tensors[f"{stem}_scales"]
        parts = ({"down_proj": (codes, scales)} if stem.endswith("down_proj") else
                 {"gate_proj": (codes[:, 0::2], scales[:, 0::2]), "up_proj": (codes[:, 1::2], scales[:, 1::2])})
        for proj, (part_codes, part_scales) in parts.items():
            mapped = names.get_name(f"{stem.rsplit('.', 1)[0]}.{proj}.weight", try_suffixes=(".weight",))
            stacks[mapped] = _ggml_mxfp4(part_codes, part_scales)
    if fused:  # gguf-py names no ffn_gate_up_exps for gpt-oss yet: llama.cpp's name, written by hand
        for layer in range(blocks):
            for kind, table in (("weight", stacks), ("bias", floats)):
                gate, up = table.pop(f"blk.{layer}.ffn_gate_exps.{kind}"), table.pop(f"blk.{layer}.ffn_up_exps.{kind}")
                table[f"blk.{layer}.ffn_gate_up_exps.{kind}"] = np.concatenate([gate, up], axis=1)
    for name, data in floats.items():
        w.add_tensor(name, data)
    for name, data in stacks.items():
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fuse-gate-up-exps"])
def test_gpt_oss_mxfp4_checkpoint_converted_to_gguf_equals_the_safetensors_run(fused, vocab, smollm2_tokenizer_dir,
                                                                                tmp_path, monkeypatch):
    """openai's MXFP4 layout converted as llama.cpp's converter does (stacks repacked, kept MXFP4; tokenizer
    pre "gpt-4o"): the file's experts dequantize (gguf-py) to the checkpoint's (transformers), stay packed
    in MXFP4, and 32 greedy tokens equal the safetensors checkpoint's exactly, its tokenizer.json splitting
    as gpt-oss's (o200k) so both tokenize the prompts alike; dequantized at load, the same tokens up to
    near-ties."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import _GPT4O_SPLIT

    from tests.quant.test_mxfp4 import write_mxfp4_experts
    from vllmpy import LLM, SamplingParams
    from vllmpy.layers.moe import ExpertLinear
    from vllmpy.loader.gguf.file import read_gguf
    from vllmpy.loader.quantization.mxfp4 import MXFP4

    hf_dir = tmp_path / "hf"
    model = make_tiny_checkpoint("GptOssForCausalLM", smollm2_tokenizer_dir, hf_dir, gpt_oss)
    tensors = write_mxfp4_experts(model, hf_dir)
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": _GPT4O_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    (hf_dir / "tokenizer.json").write_text(json.dumps(spec))
    path = tmp_path / "gpt-oss.gguf"
    _write_from_mxfp4(model, tensors, path, vocab, fused)

    _, stored = read_gguf(str(path))
    stacks = {t.name: t for t in stored if "_exps.weight" in t.name}
    assert {t.tensor_type for t in stacks.values()} == {gguf.GGMLQuantizationType.MXFP4}
    state = model.state_dict()
    for layer in range(model.config.num_hidden_layers):
        experts = f"model.layers.{layer}.mlp.experts"
        gate_up, down = state[f"{experts}.gate_up_proj"].transpose(1, 2), state[f"{experts}.down_proj"].transpose(1, 2)
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
        wanted = {"gate_up": torch.cat([gate, up], dim=1)} if fused else {"gate": gate, "up": up}
        for name, want in {**wanted, "down": down}.items():
            got = gguf.quants.dequantize(np.asarray(stacks[f"blk.{layer}.ffn_{name}_exps.weight"].data),
                                         gguf.GGMLQuantizationType.MXFP4)
            assert np.array_equal(got + 0.0, want.numpy() + 0.0), (layer, name)  # -0 decodes as +0 in ggml

    ours = LLM(model=str(path), **LLM_ARGS)
    experts = [m for m in ours.engine.core.runner.model.modules() if isinstance(m, ExpertLinear)]
    assert experts and all(m.packed is not None and m.weight.numel() == 0 for m in experts)
    assert {s.ggml_type for m in experts for segments in m.packed for s in segments} == {MXFP4}
    reference = LLM(model=str(hf_dir), **LLM_ARGS)
    prompts = [*PROMPTS, "HelloWorld don't 1234567"]
    assert [ours.get_tokenizer().encode(p) for p in prompts] == [reference.get_tokenizer().encode(p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in ours.generate(prompts, params, use_tqdm=False)]
    assert [list(t) for t in got] == [list(t) for t in expected]
    monkeypatch.setenv("VLLMPY_GGUF_KEEP_QUANT", "0")  # dequantized at load: the stacks (fused: cut along rows)
    dense = LLM(model=str(path), **LLM_ARGS)
    assert all(m.packed is None for m in dense.engine.core.runner.model.modules() if isinstance(m, ExpertLinear))
    _agree(_outputs(ours, prompts), _outputs(dense, prompts), "gpt-oss GGUF MXFP4 experts packed vs dequantized")
