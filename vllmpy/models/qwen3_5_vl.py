"""Qwen3.5 and Qwen3.5-MoE images (transformers' Qwen3_5ForConditionalGeneration and its MoE twin): the
Qwen3-VL tower without DeepStack (patch embedding, the learned position table interpolated to each grid,
2-D rotary, LayerNorm + GELU blocks, the patch merger) on the hybrid Gated DeltaNet + gated attention LM
of models/qwen3_next.py. The attention layers rotate by interleaved M-RoPE (Qwen3-VL's layout over the
partial rotary's rotary_dim / 2 frequencies, mrope_section [11, 11, 10] in the released checkpoints); the
Gated DeltaNet layers take no positions, so 3-D positions change only attention."""
from __future__ import annotations

from vllmpy.layers.moe import FUSED_EXPERT_RENAMES
from vllmpy.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from vllmpy.models.qwen3_vl import QWEN3_VL_RENAMES
from vllmpy.models.qwen3_vl import VISION_DEFAULTS as QWEN3_VL_VISION_DEFAULTS
from vllmpy.models.qwen3_vl import Qwen3VLVisionModel
from vllmpy.models.qwen_vl import QwenVLInputs

# Qwen3_5VisionConfig: Qwen3-VL's defaults with no DeepStack levels.
VISION_DEFAULTS = {**QWEN3_VL_VISION_DEFAULTS, "deepstack_visual_indexes": []}


class Qwen3_5Images(QwenVLInputs):
    """The image shell on a Qwen3.5 LM: parameters under `model.` / `lm_head.` (the LM), `visual.` (the
    tower); fused expert tensors as the MoE text model reads them."""

    checkpoint_renames = QWEN3_VL_RENAMES + FUSED_EXPERT_RENAMES
    vision_tower = Qwen3VLVisionModel
    vision_defaults = VISION_DEFAULTS
    interleaved_mrope = True


class Qwen3_5ForConditionalGeneration(Qwen3_5Images, Qwen3_5ForCausalLM):
    pass


class Qwen3_5MoeForConditionalGeneration(Qwen3_5Images, Qwen3_5MoeForCausalLM):
    pass
