"""MXFP4 safetensors (openai/gpt-oss's expert stacks: `<proj>_blocks` + e8m0 `<proj>_scales`), repacked into
GGML MXFP4 blocks at load and kept packed: values bit-identical to the OCP MX definition and to gpt-oss's own
dequantization (transformers' `convert_moe_packed_tensors`, which the gpt-oss checkpoints load through), and a
tiny gpt-oss in the real on-disk layout greedy-equal to transformers fp32 on the dequantized weights."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.gate import gate_llm
from tests.models.test_batch_invariance import _agree, _outputs
from tests.models.test_moe_families import gpt_oss
from tests.tiny_models import make_tiny_checkpoint
from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.loader.quantization.config import parse_quantization_config
from vllmpy.loader.quantization.mxfp4 import MXFP4, read_experts

# The OCP MX e2m1 code points (sign bit 3): value = E2M1[code] * 2^(scale - 127).
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GPT_OSS_QUANT = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def ocp_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., nb, 16] codes + [..., nb] scales -> [..., nb * 32] float32, from the spec: byte j holds values
    2j (low nibble) and 2j + 1; computed in float64 (exact) and rounded once (6 * 2^127 overflows)."""
    codes = np.stack([blocks & 0xF, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = np.array(E2M1)[codes] * np.exp2(scales.astype(np.float64) - 127)[..., None]
    with np.errstate(over="ignore"):
        return values.reshape(*blocks.shape[:-2], -1).astype(np.float32)


def _bits(a: np.ndarray) -> np.ndarray:
    """float32 bits with -0 as +0: GGML's code 8 decodes to +0 where the spec's e2m1 has -0 (equal values)."""
    return (np.asarray(a, np.float32) + np.float32(0.0)).view(np.uint32)


def _random_stack(rng: np.random.Generator, experts: int, rows: int, cols: int, scales=(0, 256)):
    blocks = rng.integers(0, 256, (experts, rows, cols // 32, 16), dtype=np.uint8)
    return blocks, rng.integers(*scales, (experts, rows, cols // 32), dtype=np.uint8)


def _decoded(module: str, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    got = read_experts(module, lambda name: torch.from_numpy(tensors[name]))
    assert all(packed.ggml_type == MXFP4 for _, packed in got)
    return {name: packed.dequantize().numpy() for name, packed in got}


def test_values_bit_identical_to_the_spec_and_to_gpt_oss():
    """Every scale byte (0-255) and every code in both nibbles; gate / up are gpt-oss's even / odd rows."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    experts, inter, hidden = 2, 64, 256
    gate_up, gate_up_scales = _random_stack(rng, experts, 2 * inter, hidden)
    down, down_scales = _random_stack(rng, experts, hidden, inter)
    gate_up_scales.reshape(-1)[:256] = np.arange(256)  # each e8m0 value at least once
    tensors = {"m.gate_up_proj_blocks": gate_up, "m.gate_up_proj_scales": gate_up_scales,
               "m.down_proj_blocks": down, "m.down_proj_scales": down_scales}
    ours = _decoded("m", tensors)
    for blocks, scales, proj in ((gate_up, gate_up_scales, "gate_up"), (down, down_scales, "down")):
        # gpt-oss's own dequantization ([E, in, out] as transformers keeps it); scale 255 is 2^128 there,
        # as in ggml (the OCP spec's NaN encoding, which no checkpoint stores)
        theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                            dtype=torch.float32).transpose(1, 2).numpy()
        spec = ocp_dequantize(blocks, scales)
        finite_scales = np.repeat(scales < 255, 32, axis=-1)
        for e in range(experts):
            full = (np.concatenate([ours[f"m.{e}.gate_proj.weight"], ours[f"m.{e}.up_proj.weight"]])
                    if proj == "gate_up" else ours[f"m.{e}.down_proj.weight"])
            rows = np.concatenate([theirs[e, 0::2], theirs[e, 1::2]]) if proj == "gate_up" else theirs[e]
            assert np.array_equal(_bits(full), _bits(rows)), f"{proj} expert {e} vs gpt-oss"
            spec_rows = np.concatenate([spec[e, 0::2], spec[e, 1::2]]) if proj == "gate_up" else spec[e]
            keep = (np.concatenate([finite_scales[e, 0::2], finite_scales[e, 1::2]])
                    if proj == "gate_up" else finite_scales[e])
            assert np.array_equal(_bits(full[keep]), _bits(spec_rows[keep])), f"{proj} expert {e} vs spec"
    assert np.isinf(ours["m.0.gate_proj.weight"]).any()  # 6 * 2^127 overflows, in both


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "mxfp4", "block_size": 16}, r"block_size=16.*only the keys"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.attention"]},
     r"ignores module 'model.layers.\*.attention'"),
])
def test_refusals_by_field(quant, message, tmp_path):
    from vllmpy.loader.quantization import QuantizedSafetensors

    blocks, scales = _random_stack(np.random.default_rng(1), 2, 64, 64)
    save_file({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.from_numpy(blocks),
               "model.layers.0.mlp.experts.gate_up_proj_scales": torch.from_numpy(scales),
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedCheckpointError, match=message):
        QuantizedSafetensors(str(tmp_path), parse_quantization_config(quant))


def test_refuses_a_misshapen_stack():
    blocks, scales = _random_stack(np.random.default_rng(2), 2, 64, 64)
    tensors = {"m.gate_up_proj_blocks": blocks[..., :8], "m.gate_up_proj_scales": scales,
               "m.down_proj_blocks": blocks, "m.down_proj_scales": scales}
    with pytest.raises(UnsupportedCheckpointError, match=r"m.gate_up_proj_blocks has shape \(2, 64, 2, 8\)"):
        _decoded("m", tensors)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., in] float -> gpt-oss's blocks [..., in / 32, 16] and scales: per 32 values the e8m0 scale
    2^(floor(log2 max|w|) - 2) (max maps into [4, 8): e2m1's top), each value its nearest e2m1 code."""
    groups = w.reshape(*w.shape[:-1], -1, 32).double()
    amax = groups.abs().amax(-1).clamp_min(2.0 ** -100)
    scale = (torch.floor(torch.log2(amax)) - 2 + 127).clamp(0, 254)
    lut = torch.tensor(E2M1, dtype=torch.float64)
    codes = ((groups / torch.exp2(scale - 127)[..., None]).unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), scale.to(torch.uint8)


def write_mxfp4_experts(reference: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """Rewrite the gpt-oss checkpoint in `directory` with its experts in openai's on-disk MXFP4 layout and
    quantization_config; the reference's expert stacks become gpt-oss's dequantization of what was written
    (transformers' `convert_moe_packed_tensors`). Returns the tensors written."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = {}
    for name, value in reference.state_dict().items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            blocks, scales = quantize_mxfp4(value.transpose(1, 2))  # [E, out, in] rows, as gpt-oss stores them
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            with torch.no_grad():
                value.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
        elif not (reference.config.tie_word_embeddings and name == "lm_head.weight"):
            tensors[name] = value.contiguous()
    for f in directory.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": GPT_OSS_QUANT}))
    return tensors


def test_tiny_gpt_oss_greedy_matches_transformers(smollm2_tokenizer_dir, tmp_path, monkeypatch):
    """A gpt-oss checkpoint whose experts are MXFP4 as openai ships them (interleaved gate/up rows, its
    quantization_config), computed on the packed blocks. The oracle is transformers fp32 reading the same
    directory itself (Mxfp4Config(dequantize=True)): it must hold gpt-oss's dequantization of the blocks."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from vllmpy import LLM
    from vllmpy.layers.moe import ExpertLinear

    reference = make_tiny_checkpoint("GptOssForCausalLM", smollm2_tokenizer_dir, tmp_path, gpt_oss)
    state = reference.state_dict()
    write_mxfp4_experts(reference, tmp_path)
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=Mxfp4Config(dequantize=True),
                                                  dtype=torch.float32).eval()
    theirs = oracle.state_dict()
    assert set(theirs) == set(state) and all(torch.equal(theirs[k].float(), v) for k, v in state.items())

    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=32, block_size=16)
    stacks = [m for m in llm.engine.core.model.modules() if isinstance(m, ExpertLinear)]
    assert stacks and all(m.packed is not None and m.weight.numel() == 0 for m in stacks), "experts not packed"
    assert {s.ggml_type for m in stacks for segments in m.packed for s in segments} == {MXFP4}
    result = gate_llm(llm, oracle, PROMPTS, 32, "gpt-oss mxfp4")
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == 2
    # devices without the block kernels (here forced) dequantize the experts at load: the same tokens
    monkeypatch.setenv("VLLMPY_GGUF_KEEP_QUANT", "0")
    dense = LLM(model=str(tmp_path), dtype="float32", num_blocks=32, block_size=16)
    assert all(m.packed is None for m in dense.engine.core.model.modules() if isinstance(m, ExpertLinear))
    assert _agree(_outputs(llm, PROMPTS), _outputs(dense, PROMPTS), "gpt-oss mxfp4 packed vs dense") == 0
