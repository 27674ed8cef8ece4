"""PEFT LoRA checkpoints (`adapter_config.json` + `adapter_model.safetensors`), checked against the base model.

Everything is checked when the adapter is opened, before it serves a token: a feature the checkpoint
declares that we do not compute (DoRA, modules_to_save, trained biases, embedding / LM-head adapters,
per-module rank patterns) is refused by name, never ignored. A `.bin` adapter is a pickle: refused
without being opened.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from vllmpy.layers.linear import Linear
from vllmpy.lora.request import LoRARequest
from vllmpy.models.base import CausalLM

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt")
_PREFIX = "base_model.model."
# Module names that are embeddings or the LM head in the families we serve.
_EMBEDDING_NAMES = {"embed_tokens", "lm_head", "wte", "wpe", "embed_in", "embed_out", "word_embeddings",
                    "embed_positions"}


class LoRAError(ValueError):
    """An adapter we refuse; the message names the adapter, the key or tensor, and what is supported."""


@dataclass
class ShardDelta:
    """One target projection's low-rank pair, placed in its layer: rank block `block` (the fused shard's
    index, 0 for a whole module) and output columns [out_offset, out_offset + b.shape[0])."""

    block: int
    out_offset: int
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r], the adapter's scaling folded in


@dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int
    deltas: dict[str, list[ShardDelta]]  # our Linear module's name -> its projections' deltas


def lora_modules(model: CausalLM) -> dict[str, Linear]:
    """The linear layers an adapter may target: every Linear but the LM head."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, Linear) and name != "lm_head"}


def load_adapter(request: LoRARequest, model: CausalLM, max_rank: int) -> LoRAAdapter:
    """Open, check and place the adapter's tensors on `model`'s layers (CPU float32; scaling folded into B)."""
    where = f"LoRA adapter {request.lora_name!r}"
    path = Path(request.lora_path)
    if not path.is_dir():
        raise LoRAError(f"{where}: lora_path {str(path)!r} is not a directory (a PEFT adapter directory with "
                        f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    config = _read_config(path, where)
    rank, scaling = _check_config(config, model, max_rank, where)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        pickles = [name for name in PICKLE_FILES if (path / name).exists()]
        if pickles:
            raise LoRAError(f"{where}: {pickles[0]} is a pickle, which vllmpy never loads; save the adapter as "
                            f"{WEIGHTS_FILE} (PEFT's save_pretrained(safe_serialization=True))")
        raise LoRAError(f"{where}: {path} has no {WEIGHTS_FILE}")
    pairs = _pairs(load_file(str(weights)), where)
    _check_targets(config.get("target_modules"), {module.rsplit(".", 1)[-1] for module in pairs}, model, where)
    modules = lora_modules(model)
    deltas: dict[str, list[ShardDelta]] = {}
    for ckpt_module, (a, b) in pairs.items():
        name, delta = _place(ckpt_module, a, b, model, modules, rank, scaling, where)
        deltas.setdefault(name, []).append(delta)
    if not deltas:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} holds no lora_A / lora_B tensors")
    return LoRAAdapter(request, rank, deltas)


def _read_config(path: Path, where: str) -> dict:
    try:
        return json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoRAError(f"{where}: {path} has no {CONFIG_FILE}") from None
    except json.JSONDecodeError as exc:
        raise LoRAError(f"{where}: {CONFIG_FILE} is not valid JSON ({exc})") from None


def _check_config(config: dict, model: CausalLM, max_rank: int, where: str) -> tuple[int, float]:
    """(rank, scaling) of a config we can serve; refuses each declared feature we do not compute."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: peft_type {config.get('peft_type')!r} is not supported; only LORA")
    if config.get("use_dora"):
        raise LoRAError(f"{where}: use_dora (DoRA) is not supported; only plain LoRA")
    if config.get("modules_to_save"):
        raise LoRAError(f"{where}: modules_to_save {config['modules_to_save']} is not supported (fully trained "
                        f"modules); only lora_A / lora_B pairs")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias {config['bias']!r} is not supported (trained biases); only 'none'")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoRAError(f"{where}: {key} is not supported; one r and lora_alpha for every module")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"{where}: rank r={rank} is above --max-lora-rank {max_rank}; raise --max-lora-rank")
    alpha = config.get("lora_alpha", rank)
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _check_targets(targets: object, trained: set[str], model: CausalLM, where: str) -> None:
    """Each listed target_modules entry must be a linear layer we adapt: one of our layers' names (or a name
    fused into one: q_proj -> qkv_proj), or a module the adapter holds tensors for (a family's own checkpoint
    names, which `_place` maps and checks). A regex string is matched by peft: its tensors are checked."""
    if not isinstance(targets, list):
        return
    leaves = {name.rsplit(".", 1)[-1] for name in lora_modules(model)}
    supported = leaves | {ckpt for ckpt, (fused, _) in model.packed_modules_mapping.items() if fused in leaves}
    for target in targets:
        if target in _EMBEDDING_NAMES:
            raise LoRAError(f"{where}: target module {target!r} is an embedding or the LM head, which LoRA is not "
                            f"supported on; supported: {', '.join(sorted(supported))}")
        if target not in supported and target not in trained:
            raise LoRAError(f"{where}: target module {target!r} is not a linear layer of {type(model).__name__}; "
                            f"supported: {', '.join(sorted(supported))}")


def _pairs(tensors: dict[str, torch.Tensor], where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """checkpoint module name -> (lora_A [r, in], lora_B [out, r]); any other tensor is refused by name."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(_PREFIX)
        if ".lora_embedding_" in name:
            raise LoRAError(f"{where}: tensor {key!r} adapts an embedding, which is not supported")
        if ".lora_magnitude_vector" in name:
            raise LoRAError(f"{where}: tensor {key!r} is a DoRA magnitude, which is not supported")
        for part in ("A", "B"):
            suffix = f".lora_{part}.weight"
            if name.endswith(suffix):
                found.setdefault(name.removesuffix(suffix), {})[part] = tensor
                break
        else:
            raise LoRAError(f"{where}: tensor {key!r} is not a lora_A / lora_B weight (modules_to_save or "
                            f"biases are not supported)")
    pairs = {}
    for module, parts in found.items():
        if set(parts) != {"A", "B"}:
            missing = "lora_B" if "A" in parts else "lora_A"
            raise LoRAError(f"{where}: module {module!r} has no {missing} tensor")
        pairs[module] = (parts["A"], parts["B"])
    return pairs


def _place(ckpt_module: str, a: torch.Tensor, b: torch.Tensor, model: CausalLM, modules: dict[str, Linear],
           rank: int, scaling: float, where: str) -> tuple[str, ShardDelta]:
    """Our layer's name and the delta's place in it (a fused layer's shard), shapes checked."""
    leaf = ckpt_module.rsplit(".", 1)[-1]
    if leaf in _EMBEDDING_NAMES:
        raise LoRAError(f"{where}: module {ckpt_module!r} is an embedding or the LM head, which LoRA is not "
                        f"supported on")
    param, shard = model.checkpoint_name_to_param(f"{ckpt_module}.weight")
    name = param.removesuffix(".weight")
    layer = modules.get(name)
    if layer is None:
        raise LoRAError(f"{where}: module {ckpt_module!r} is not a linear layer of {type(model).__name__}")
    offsets = getattr(layer, "shard_offsets", None)
    if shard is None:
        block, out_offset, out_size = 0, 0, layer.out_features
    else:
        block, (out_offset, out_size) = list(offsets).index(shard), offsets[shard]
    if a.dim() != 2 or a.shape != (rank, layer.in_features):
        raise LoRAError(f"{where}: {ckpt_module}.lora_A is {tuple(a.shape)}, expected (r={rank}, "
                        f"in={layer.in_features})")
    if b.dim() != 2 or b.shape != (out_size, rank):
        raise LoRAError(f"{where}: {ckpt_module}.lora_B is {tuple(b.shape)}, expected (out={out_size}, r={rank})")
    return name, ShardDelta(block, out_offset, a.float(), b.float() * scaling)
