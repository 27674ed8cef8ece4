"""Tiny quantized checkpoints in each format's on-disk layout, from a random transformers model whose
linear weights are then replaced by the reference dequantization (tests/quant/reference.py): that model is
the token oracle for the quantized checkpoint."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.quant import reference as ref
from tests.tiny_models import _base, make_tiny_checkpoint

_QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$")
_CT_IGNORE = ["lm_head", "re:.*mlp.gate$"]


def _ct(fmt: str, weights: dict, acts: dict | None = None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": _CT_IGNORE}


# format id -> quantization_config
CONFIGS = {
    "gptq-int4-g32-act-order": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
                                "checkpoint_format": "gptq"},
    "gptq-int8-channel": {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False, "sym": True},
    "gptq-int4-g128-asym": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False,
                            "checkpoint_format": "gptq"},
    "awq-int4-g64": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm",
                     "modules_to_not_convert": None},
    "awq-int4-g128": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "awq-int4-g32": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    "ct-w4a16-asym-g32": _ct("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": False,
                                                "strategy": "group", "group_size": 32}),
    "ct-w4a16-asym-g128": _ct("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": False,
                                                 "strategy": "group", "group_size": 128}),
    "ct-w8a16-channel": _ct("pack-quantized", {"num_bits": 8, "type": "int", "symmetric": True,
                                               "strategy": "channel"}),
    "ct-w8a8-int": _ct("int-quantized", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                       {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}),
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "fp8-tensor-static": {"quant_method": "fp8", "activation_scheme": "static"},
    "ct-fp8-channel": _ct("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True,
                                              "strategy": "channel"},
                          {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}),
}


def _wide_llama(vocab: int):
    """The tiny Llama with hidden 128 and intermediate 256: every linear's input a whole group of 128 (or two)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**_base(vocab), "hidden_size": 128, "intermediate_size": 256})


def quantize_module(fmt: str, w: torch.Tensor, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The module's tensors (names without the module prefix) and the reference dequantized weight."""
    g = torch.Generator().manual_seed(seed)
    config = CONFIGS[fmt]
    if fmt.startswith("gptq"):
        bits, group, sym = config["bits"], config["group_size"], config["sym"]
        perm = torch.randperm(w.shape[1], generator=g) if config["desc_act"] else torch.arange(w.shape[1])
        q_perm, zeros, scales = ref.quantize(w[:, perm], bits, group, sym)
        q = torch.empty_like(q_perm)
        q[:, perm] = q_perm
        g_idx = torch.empty(w.shape[1], dtype=torch.int64)
        g_idx[perm] = torch.arange(w.shape[1]) // (w.shape[1] if group == -1 else group)
        t = ref.gptq_tensors(q, zeros, scales, bits, g_idx, v1=True)
        return t, ref.gptq_dequantize(t, bits, v1=True)
    if fmt.startswith("awq"):
        t = ref.awq_tensors(*ref.quantize(w, 4, config["group_size"], sym=False))
        return t, ref.awq_dequantize(t)
    if config.get("format") == "pack-quantized":
        weights = config["config_groups"]["group_0"]["weights"]
        bits, group, sym = weights["num_bits"], weights.get("group_size", -1), weights["symmetric"]
        t = ref.ct_packed_tensors(*ref.quantize(w, bits, group, sym), bits, sym)
        return t, ref.ct_int_dequantize(t, bits)
    if fmt == "ct-w8a8-int":
        q, _, scales = ref.quantize(w, 8, -1, sym=True)
        t = {"weight": (q - 128).to(torch.int8), "weight_scale": scales.float()}
        return t, scales.float() * (q - 128).float()
    strategy = {"fp8-block": "block", "fp8-tensor-static": "tensor", "ct-fp8-channel": "channel"}[fmt]
    codes, scale = ref.fp8_quantize(w, strategy)
    block = (128, 128) if strategy == "block" else None
    t = {"weight": codes, "weight_scale_inv" if block else "weight_scale": scale}
    if strategy == "tensor":
        t["input_scale"] = torch.tensor([0.02])
    return t, ref.fp8_dequantize(codes, scale, block)


def _split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert stacks as the per-expert 2-D weights quantized checkpoints store."""
    out = {}
    for name, t in state.items():
        if name.endswith(".experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :half]
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, half:]
        elif name.endswith(".experts.down_proj"):
            for e in range(t.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e]
        else:
            out[name] = t
    return out


def _write_back(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Put a dequantized per-expert or plain weight back into the transformers model."""
    params = dict(model.named_parameters())
    match = re.search(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
    if match is None:
        params[name].data.copy_(value)
        return
    e, part = int(match[1]), match[2]
    base = name[:match.start()] + ".experts."
    if part == "down_proj":
        params[base + "down_proj"].data[e].copy_(value)
    else:
        stack = params[base + "gate_up_proj"].data[e]
        half = stack.shape[0] // 2
        (stack[:half] if part == "gate_proj" else stack[half:]).copy_(value)


def make_quantized_checkpoint(arch: str, fmt: str, tokenizer_dir: str, out: Path) -> torch.nn.Module:
    """Write `arch` quantized as `fmt` into `out`; return the transformers model on the dequantized weights.
    The group-128 formats (`-g128`) take the wider Llama (`_wide_llama`), the hidden 64 of the others being less
    than a group."""
    if "-g128" in fmt and arch != "LlamaForCausalLM":
        raise ValueError(f"{fmt}: the group-128 formats are written for LlamaForCausalLM only")
    model = make_tiny_checkpoint(arch, tokenizer_dir, out, _wide_llama if "-g128" in fmt else None)
    for f in out.glob("*.safetensors"):
        f.unlink()
    state, tensors = _split_experts({k: v.detach().clone() for k, v in model.state_dict().items()}), {}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for i, (name, w) in enumerate(sorted(state.items())):
        module = name[:-len(".weight")]
        if not name.endswith(".weight") or not _QUANTIZED.search(module):
            tensors[name] = w.contiguous()
            continue
        parts, dequantized = quantize_module(fmt, w, seed=i)
        tensors.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
        with torch.no_grad():
            _write_back(model, name, dequantized)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = CONFIGS[fmt]
    (out / "config.json").write_text(json.dumps(config))
    return model
