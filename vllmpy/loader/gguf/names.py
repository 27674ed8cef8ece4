"""llama.cpp tensor names -> HF checkpoint names, through an architecture's tables."""
from __future__ import annotations

import re
from dataclasses import dataclass

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.loader.gguf.archs import ArchSpec

# The kind is optional: Mamba2's A and D are stored bare (`blk.N.ssm_a`); LFM2's leaves hold a dot.
_BLOCK = re.compile(r"blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?")
_GLOBAL = re.compile(r"(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class TensorName:
    key: str  # GGUF leaf.kind (`attn_q.weight`): what per-arch transforms are keyed by
    hf: str


def hf_name(spec: ArchSpec, name: str, num_layers: int, num_mtp_layers: int = 0) -> TensorName | None:
    """The HF name of GGUF tensor `name`, or None when the architecture has no such tensor. Layers
    num_layers.. are the MTP blocks, which also hold `spec.mtp_names` (named as in HF checkpoints:
    `model.layers.{num_layers}.eh_proj.weight`)."""
    if match := _BLOCK.fullmatch(name):
        layer, leaf, kind = int(match[1]), match[2], match[3]
        key = f"{leaf}.{kind}" if kind else leaf
        names = spec.layer_names
        if layer >= num_layers and (key in spec.mtp_names or leaf in spec.mtp_names):
            names = spec.mtp_names
        if key in names:  # a whole HF name (`ssm_dt.bias` -> `mixer.dt_bias`)
            hf = names[key]
        elif kind and leaf in names:
            hf = f"{names[leaf]}.{kind}"
        else:
            return None
        if layer >= num_layers + num_mtp_layers:
            raise UnsupportedCheckpointError(
                f"tensor {name!r} belongs to layer {layer}, but the GGUF declares {num_layers} layers"
                + (f" and {num_mtp_layers} MTP layers (nextn_predict_layers)" if num_mtp_layers else ""))
        return TensorName(key, f"model.layers.{layer}.{hf}")
    if (match := _GLOBAL.fullmatch(name)) and match[1] in spec.global_names:
        return TensorName(name, f"{spec.global_names[match[1]]}.{match[2]}")
    return None
