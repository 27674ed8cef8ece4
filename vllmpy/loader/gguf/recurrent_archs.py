"""The llama.cpp architectures with recurrent layers, as `ArchSpec`s: the Mamba2 families (`mamba2`,
`granitehybrid`, `nemotron_h`, `falcon-h1`), the Gated DeltaNet hybrids (`qwen35`, `qwen35moe`,
`qwen3next`) and LFM2's short conv (`lfm2`).

Their converters state the layer pattern per layer (head_count_kv 0 on recurrent layers, Nemotron-H's
feed_forward_length 0 off its MLP layers) or as an interval (Qwen's full_attention_interval), and change
the mixers' tensors: A stored as -exp(A_log), convs squeezed, norms reshaped or offset, Falcon-H1's muP
multipliers folded into the weights, Qwen3.5's value heads tiled, Qwen3-Next's projections regrouped.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.loader.gguf.archs import (ATTENTION_NAMES, GLOBAL_NAMES, GRANITE_SCALES, LLAMA_ROPE_UNPERMUTE, MLP_NAMES,
                                      MOE_NAMES, QK_NORM_NAMES, SHARED_EXPERT_NAMES, ArchSpec, partial_rotary)
from vllmpy.loader.gguf.metadata import ArchMetadata
from vllmpy.loader.gguf.transforms import (AsRow, Chain, ChannelConv, Flatten, NegExpToLog, SubtractOffset,
                                           Transform, UninterleaveBetaAlpha, UntileValueHeads)

if TYPE_CHECKING:
    import numpy as np


def ssm_names(mixer: str) -> dict[str, str]:
    """llama.cpp's Mamba2 mixer tensors -> HF's under `mixer`: dt_bias is written `ssm_dt.bias`, A and D bare."""
    return {"ssm_in": f"{mixer}.in_proj", "ssm_conv1d": f"{mixer}.conv1d", "ssm_dt.bias": f"{mixer}.dt_bias",
            "ssm_a": f"{mixer}.A_log", "ssm_d": f"{mixer}.D", "ssm_norm": f"{mixer}.norm",
            "ssm_out": f"{mixer}.out_proj"}


# The Mamba2 converter squeezes the conv to [C, K], reshapes D to [H, 1] and the norm to [groups, I / groups],
# and stores A = -exp(A_log).
SSM_TRANSFORMS: dict[str, Transform] = {"ssm_conv1d.weight": ChannelConv(), "ssm_a": NegExpToLog(),
                                        "ssm_d": Flatten(), "ssm_norm.weight": Flatten()}


def _ssm_sizes(meta: ArchMetadata, hidden: int, whole_expand: bool = True) -> dict[str, int]:
    """The mixer's sizes as the converter states them; time_step_rank is the SSM head count. Falcon-H1's
    inner size (mamba_d_ssm) need not be a multiple of the hidden size (whole_expand off)."""
    inner, heads = meta.integer("ssm.inner_size"), meta.integer("ssm.time_step_rank")
    if heads <= 0 or inner % heads or (whole_expand and inner % hidden):
        multiple = f" and of embedding_length {hidden}" if whole_expand else ""
        raise UnsupportedCheckpointError(
            f"GGUF {meta.key('ssm.inner_size')}={inner} must be a multiple of {meta.key('ssm.time_step_rank')}"
            f"={heads} heads{multiple}")
    return {"heads": heads, "head_dim": inner // heads, "groups": meta.integer("ssm.group_count"),
            "state": meta.integer("ssm.state_size"), "conv": meta.integer("ssm.conv_kernel"),
            "expand": inner // hidden}  # whole only when whole_expand


def _mamba2_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """Mamba2's converter states head_count 0 and feed_forward_length 0: attention-free, no MLP."""
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        config.pop(key)
    ssm = _ssm_sizes(meta, config["hidden_size"])
    return {"num_heads": ssm["heads"], "head_dim": ssm["head_dim"], "n_groups": ssm["groups"],
            "state_size": ssm["state"], "conv_kernel": ssm["conv"], "expand": ssm["expand"]}


def _attention_layers(meta: ArchMetadata, layers: int) -> list[bool]:
    """Hybrids' head_count_kv lists one count per layer, 0 on the recurrent ones."""
    per_layer = meta.raw("attention.head_count_kv")
    if not isinstance(per_layer, list) or len(per_layer) != layers:
        raise UnsupportedCheckpointError(
            f"GGUF {meta.key('attention.head_count_kv')!r} must list one head count per layer ({layers} layers)")
    return [bool(heads) for heads in per_layer]


# Granite 4.0-H and Bamba (both `granitehybrid`): Mamba2 or attention per layer, a shared MLP (ffn_* when
# dense, ffn_*_shexp beside the experts), the experts' input_linear split into gate and up stacks.
GRANITE_HYBRID_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **ATTENTION_NAMES,
    **ssm_names("linear_attn"), "ffn_gate_inp": "mlp.moe.gate", "ffn_gate_exps": "mlp.moe.experts.gate_proj",
    "ffn_up_exps": "mlp.moe.experts.up_proj", "ffn_down_exps": "mlp.moe.experts.down_proj",
    "ffn_gate": "mlp.shared.gate_proj", "ffn_up": "mlp.shared.up_proj", "ffn_down": "mlp.shared.down_proj",
    "ffn_gate_shexp": "mlp.shared.gate_proj", "ffn_up_shexp": "mlp.shared.up_proj",
    "ffn_down_shexp": "mlp.shared.down_proj",
}


def _granite_hybrid_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """The layer pattern is head_count_kv per layer (0: Mamba2); llama.cpp's rope switch for the family is
    rope.scaling.finetuned (Bamba ropes, Granite 4.0-H is NoPE)."""
    attention = _attention_layers(meta, config["num_hidden_layers"])
    ssm = _ssm_sizes(meta, config["hidden_size"])
    rope = bool(meta.raw("rope.scaling.finetuned", False))
    experts = meta.integer("expert_count", 0)
    return {
        "layer_types": ["attention" if a else "mamba" for a in attention],
        "position_embedding_type": "rope" if rope else "nope", **(partial_rotary(meta, config) if rope else {}),
        "mamba_n_heads": ssm["heads"], "mamba_d_head": ssm["head_dim"], "mamba_n_groups": ssm["groups"],
        "mamba_d_state": ssm["state"], "mamba_d_conv": ssm["conv"], "mamba_expand": ssm["expand"],
        "num_local_experts": experts, "num_experts_per_tok": meta.integer("expert_used_count", 0),
        "shared_intermediate_size": meta.integer("expert_shared_feed_forward_length", config["intermediate_size"]),
    }



# LFM2's short-conv layers (`shortconv.*`, the conv squeezed to [C, K]) beside attention with q/k norms;
# its final norm is llama.cpp's token_embd_norm (HF's embedding_norm).
LFM2_LAYER_NAMES = {
    "attn_norm": "operator_norm", "ffn_norm": "ffn_norm", **ATTENTION_NAMES, "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm",
    "shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj",
    "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
}


def _lfm2_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """feed_forward_length is the MLP's built width (the converter applies block_auto_adjust_ff_dim)."""
    attention = _attention_layers(meta, config["num_hidden_layers"])
    return {"layer_types": ["full_attention" if a else "conv" for a in attention], "block_auto_adjust_ff_dim": False,
            "conv_L_cache": meta.integer("shortconv.l_cache"), "norm_eps": config["rms_norm_eps"]}


def _per_layer(meta: ArchMetadata, suffix: str, layers: int) -> list[int]:
    """A key the converter writes once per layer."""
    values = meta.raw(suffix)
    if not isinstance(values, list) or len(values) != layers:
        raise UnsupportedCheckpointError(f"GGUF {meta.key(suffix)!r} must list one value per layer ({layers} layers)")
    return values


# Nemotron-H: one mixer per layer under `mixer` (Mamba2, NoPE attention, or the ungated relu^2 MLP).
NEMOTRON_H_LAYER_NAMES = {
    "attn_norm": "norm", **ssm_names("mixer"), "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj",
    "attn_v": "mixer.v_proj", "attn_output": "mixer.o_proj", "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj",
}


def _nemotron_h_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """The mixer of each layer: attention where head_count_kv > 0, the MLP where feed_forward_length > 0,
    else Mamba2 (llama.cpp's rule). llama.cpp floors dt at nothing (transformers at time_step_min)."""
    layers = config["num_hidden_layers"]
    kv, ff = _per_layer(meta, "attention.head_count_kv", layers), _per_layer(meta, "feed_forward_length", layers)
    kinds = ["full_attention" if k else "mlp" if f else "linear_attention" for k, f in zip(kv, ff)]
    ssm = _ssm_sizes(meta, config["hidden_size"], whole_expand=False)
    return {"layers_block_type": kinds, "mamba_num_heads": ssm["heads"], "mamba_head_dim": ssm["head_dim"],
            "n_groups": ssm["groups"], "ssm_state_size": ssm["state"], "conv_kernel": ssm["conv"],
            "time_step_min": 0.0}


# Falcon-H1: Mamba2 (`mamba`) beside attention in every layer, then a gated MLP (`feed_forward`).
FALCON_H1_LAYER_NAMES = {
    "attn_norm": "input_layernorm", **ATTENTION_NAMES, **ssm_names("mamba"), "ffn_norm": "pre_ff_layernorm",
    "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj", "ffn_down": "feed_forward.down_proj",
}
# The converter folds every muP multiplier into the weights it scales, so the file's model has them all at 1.
FALCON_H1_UNIT_MULTIPLIERS = {
    "embedding_multiplier": 1.0, "lm_head_multiplier": 1.0, "mlp_multipliers": [1.0, 1.0], "key_multiplier": 1.0,
    "attention_in_multiplier": 1.0, "attention_out_multiplier": 1.0, "ssm_in_multiplier": 1.0,
    "ssm_out_multiplier": 1.0, "ssm_multipliers": [1.0] * 5,
}


def _falcon_h1_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """A mixer norm is there when its tensor is (mamba_rms_norm); llama.cpp gates y by silu(z), then normalizes."""
    ssm = _ssm_sizes(meta, config["hidden_size"], whole_expand=False)
    return {"mamba_d_ssm": ssm["heads"] * ssm["head_dim"], "mamba_n_heads": ssm["heads"],
            "mamba_d_head": ssm["head_dim"], "mamba_n_groups": ssm["groups"], "mamba_d_state": ssm["state"],
            "mamba_d_conv": ssm["conv"], "mamba_norm_before_gate": False}


# Qwen3.5 / Qwen3-Next: Gated DeltaNet (`linear_attn`) or gated attention per layer; qkv, z, b, a as the
# converter names them (Qwen3-Next's qkvz split into attn_qkv / attn_gate, its ba kept whole).
GDN_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm", **ATTENTION_NAMES,
    **QK_NORM_NAMES, "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a", "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_dt.bias": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log",
    "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj", **MLP_NAMES, **MOE_NAMES, **SHARED_EXPERT_NAMES,
}
# Every norm but the delta rule's output norm is zero-centred in HF (x (1 + w)); the converter stores 1 + w.
GDN_NORM_OFFSETS: dict[str, Transform] = {
    f"{leaf}.weight": SubtractOffset(1.0)
    for leaf in ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm")}
QWEN3NEXT_TRANSFORMS: dict[str, Transform] = {
    **GDN_NORM_OFFSETS, "ssm_conv1d.weight": ChannelConv(), "ssm_a": NegExpToLog(),
    "ssm_ba.weight": UninterleaveBetaAlpha(), "ffn_gate_inp_shexp.weight": AsRow(),
}
# Qwen3.5's converter also tiles the value heads (UntileValueHeads) wherever they index an axis.
QWEN35_TRANSFORMS: dict[str, Transform] = {
    **GDN_NORM_OFFSETS, "ffn_gate_inp_shexp.weight": AsRow(),
    "attn_qkv.weight": UntileValueHeads(0, "value", skip_qk=True), "attn_gate.weight": UntileValueHeads(0, "value"),
    "ssm_beta.weight": UntileValueHeads(0, "one"), "ssm_alpha.weight": UntileValueHeads(0, "one"),
    "ssm_dt.bias": UntileValueHeads(0, "one"), "ssm_a": Chain((NegExpToLog(), UntileValueHeads(0, "one"))),
    "ssm_conv1d.weight": Chain((UntileValueHeads(0, "value", skip_qk=True), ChannelConv())),
    "ssm_out.weight": UntileValueHeads(1, "value"),
}


def _gdn_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """The GDN sizes (group_count: key heads, time_step_rank: value heads, state_size: the key head size),
    llama.cpp's layer rule (every full_attention_interval-th layer attends) and the MTP blocks Qwen3.5's
    converter appends after the decoder (counted in block_count, nextn_predict_layers)."""
    nextn = meta.integer("nextn_predict_layers", 0)
    layers = config["num_hidden_layers"] - nextn
    interval = meta.integer("full_attention_interval", 4)
    ssm = _ssm_sizes(meta, config["hidden_size"], whole_expand=False)
    extra = {
        "num_hidden_layers": layers, "num_nextn_predict_layers": nextn, "full_attention_interval": interval,
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        "linear_num_key_heads": ssm["groups"], "linear_num_value_heads": ssm["heads"],
        "linear_key_head_dim": ssm["state"], "linear_value_head_dim": ssm["head_dim"],
        "linear_conv_kernel_dim": ssm["conv"], **partial_rotary(meta, config),
    }
    if meta.has("expert_count"):
        extra.update(num_experts=meta.integer("expert_count"), num_experts_per_tok=meta.integer("expert_used_count"),
                     moe_intermediate_size=meta.integer("expert_feed_forward_length"))
    return extra


# The sparse GDN hybrids (Qwen3.5-MoE, Qwen3-Next): every layer sparse, so no dense MLP and the converter
# may state no feed_forward_length.
GDN_MOE = dict(
    hf_architecture="Qwen3_5MoeForCausalLM", model_type="qwen3_5_moe_text", layer_names=GDN_LAYER_NAMES,
    config_constants={"hidden_act": "silu", "intermediate_size": 0},
    optional_keys={"shared_expert_intermediate_size": "expert_shared_feed_forward_length"},
    head_dim_keys=("attention.key_length",), tensor_flags={"attention_bias": "attn_q.bias"}, extra_config=_gdn_config,
)


RECURRENT_ARCHS: dict[str, ArchSpec] = {
    "mamba2": ArchSpec(
        hf_architecture="Mamba2ForCausalLM",
        model_type="mamba2",
        layer_names={"attn_norm": "norm", **ssm_names("mixer")},
        config_constants={"hidden_act": "silu"},
        head_dim_keys=(),
        tensor_flags={"use_bias": "ssm_in.bias", "use_conv_bias": "ssm_conv1d.bias"},
        transforms=SSM_TRANSFORMS,
        extra_config=_mamba2_config,
    ),
    "granitehybrid": ArchSpec(
        hf_architecture="GraniteMoeHybridForCausalLM",
        model_type="granitemoehybrid",
        layer_names=GRANITE_HYBRID_LAYER_NAMES,
        config_constants={"hidden_act": "silu"},
        optional_keys=GRANITE_SCALES,
        head_dim_keys=("attention.key_length",),  # Bamba's rope.dimension_count is the rotated half
        tensor_flags={"attention_bias": "attn_q.bias", "mamba_conv_bias": "ssm_conv1d.bias",
                      "mamba_proj_bias": "ssm_in.bias"},
        transforms={**LLAMA_ROPE_UNPERMUTE, **SSM_TRANSFORMS},
        extra_config=_granite_hybrid_config,
    ),
    "lfm2": ArchSpec(
        hf_architecture="Lfm2ForCausalLM",
        model_type="lfm2",
        layer_names=LFM2_LAYER_NAMES,
        global_names={**GLOBAL_NAMES, "token_embd_norm": "model.embedding_norm"},
        config_constants={"hidden_act": "silu"},
        head_dim_keys=("attention.key_length",),
        tensor_flags={"conv_bias": "shortconv.conv.bias"},
        transforms={"shortconv.conv.weight": ChannelConv()},
        extra_config=_lfm2_config,
    ),
    "nemotron_h": ArchSpec(
        hf_architecture="NemotronHForCausalLM",
        model_type="nemotron_h",
        layer_names=NEMOTRON_H_LAYER_NAMES,
        config_constants={"mamba_hidden_act": "silu", "mlp_hidden_act": "relu2"},
        head_dim_keys=("attention.key_length",),
        tensor_flags={"use_bias": "ssm_in.bias", "use_conv_bias": "ssm_conv1d.bias", "attention_bias": "attn_q.bias",
                      "mlp_bias": "ffn_up.bias"},
        # GraniteHybridModel's undo_permute reaches Nemotron-H's (NoPE) q / k rows too
        transforms={**LLAMA_ROPE_UNPERMUTE, **SSM_TRANSFORMS},
        extra_config=_nemotron_h_config,
    ),
    "falcon-h1": ArchSpec(
        hf_architecture="FalconH1ForCausalLM",
        model_type="falcon_h1",
        layer_names=FALCON_H1_LAYER_NAMES,
        config_constants={"hidden_act": "silu", **FALCON_H1_UNIT_MULTIPLIERS},
        head_dim_keys=("attention.key_length",),
        tensor_flags={"mamba_rms_norm": "ssm_norm.weight", "mamba_conv_bias": "ssm_conv1d.bias",
                      "mamba_proj_bias": "ssm_in.bias", "projectors_bias": "ssm_out.bias",
                      "attention_bias": "attn_q.bias", "mlp_bias": "ffn_up.bias"},
        transforms=SSM_TRANSFORMS,
        extra_config=_falcon_h1_config,
    ),
    "qwen35": ArchSpec(
        hf_architecture="Qwen3_5ForCausalLM",
        model_type="qwen3_5_text",
        layer_names=GDN_LAYER_NAMES,
        config_constants={"hidden_act": "silu"},
        head_dim_keys=("attention.key_length",),
        tensor_flags={"attention_bias": "attn_q.bias"},
        transforms=QWEN35_TRANSFORMS,
        extra_config=_gdn_config,
    ),
    "qwen35moe": ArchSpec(**GDN_MOE, transforms=QWEN35_TRANSFORMS),
    # llama.cpp's Qwen3-Next: every layer sparse, top-k renormalized, the GDN projections regrouped by the
    # converter into Qwen3.5's split layout; served by Qwen3.5-MoE's model, which computes the same.
    "qwen3next": ArchSpec(**GDN_MOE, transforms=QWEN3NEXT_TRANSFORMS,
                          splits={"ssm_ba.weight": ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight")}),
}
