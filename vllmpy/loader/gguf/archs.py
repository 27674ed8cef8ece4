"""What differs between llama.cpp architectures, as data: supporting one more is one `ArchSpec` entry.

Names are llama.cpp's (`blk.N.attn_q.weight`) mapped to HF's (`model.layers.N.self_attn.q_proj.weight`)
by leaf; transforms are keyed by GGUF leaf and kind (`attn_q.weight`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.loader.gguf.metadata import ArchMetadata
from vllmpy.loader.gguf.transforms import AsRow, SubtractOffset, Transform, UnpermuteRope

if TYPE_CHECKING:
    import numpy as np

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

ATTENTION_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
MLP_NAMES = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
LLAMA_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    **ATTENTION_NAMES,
    **MLP_NAMES,
}
# Gemma 2/3 normalise both before and after attention and the MLP.
GEMMA_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    **ATTENTION_NAMES,
    **QK_NORM_NAMES,
    **MLP_NAMES,
}

# Sparse MoE layers: the router, then each projection of every expert stacked [E, out, in].
MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
             "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}
# Qwen2-MoE's always-on shared expert and its sigmoid gate.
SHARED_EXPERT_NAMES = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                       "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}

# Layer names of the LayerNorm families whose HF names are Llama's (StableLM, Command-R / Cohere 2).
LAYERNORM_LLAMA_NAMES = {**LLAMA_LAYER_NAMES, **QK_NORM_NAMES}
# GPT-2's HF names are Conv1D modules stored transposed; its GGUF tensors go to vllmpy's own names.
GPT2_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2",
}
# Phi-3 and GLM-4 keep q/k/v (sometimes) and gate/up (always) fused; llama.cpp names gate_up `ffn_up`.
FUSED_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}

# Granite's muP scalars under the names its converter writes.
GRANITE_SCALES = {"attention_multiplier": "attention.scale", "embedding_multiplier": "embedding_scale",
                  "residual_multiplier": "residual_scale", "logits_scaling": "logit_scale"}
# HF config key -> `{arch}.` metadata suffix, read when present.
OPTIONAL_KEYS = {"sliding_window": "attention.sliding_window"}
LAYER_NORM_EPS = ("layer_norm_eps", "attention.layer_norm_epsilon")

# The llama converter interleaves q/k rows (and biases) per head for llama.cpp's rope.
LLAMA_ROPE_UNPERMUTE: dict[str, Transform] = {
    "attn_q.weight": UnpermuteRope("num_attention_heads"),
    "attn_q.bias": UnpermuteRope("num_attention_heads"),
    "attn_k.weight": UnpermuteRope("num_key_value_heads"),
    "attn_k.bias": UnpermuteRope("num_key_value_heads"),
}


def _norm_offsets(layer_names: Mapping[str, str]) -> dict[str, Transform]:
    """Every RMSNorm weight (llama.cpp's converter offsets each one whose HF name ends in `norm.weight`)."""
    leaves = [leaf for leaf, hf in layer_names.items() if hf.endswith("norm")] + ["output_norm"]
    return {f"{leaf}.weight": SubtractOffset(1.0) for leaf in leaves}


@dataclass(frozen=True)
class ArchSpec:
    hf_architecture: str  # config.json `architectures[0]`
    model_type: str
    layer_names: Mapping[str, str]  # GGUF block leaf -> HF leaf under model.layers.N
    global_names: Mapping[str, str] = field(default_factory=lambda: GLOBAL_NAMES)
    config_constants: Mapping[str, Any] = field(default_factory=dict)  # HF keys llama.cpp does not store
    optional_keys: Mapping[str, str] = field(default_factory=lambda: OPTIONAL_KEYS)
    # Metadata suffixes giving head_dim, in order; hidden_size // heads when none is present.
    head_dim_keys: tuple[str, ...] = ("attention.key_length", "rope.dimension_count")
    # HF config key -> GGUF block leaf.kind whose presence in any layer sets it True.
    tensor_flags: Mapping[str, str] = field(default_factory=dict)
    transforms: Mapping[str, Transform] = field(default_factory=dict)  # GGUF leaf.kind -> transform
    # Tensors that describe the config rather than hold weights (consumed, never yielded).
    config_tensors: frozenset[str] = frozenset()
    # Architecture-specific config keys derived from the metadata, the common config and the values of
    # the config tensors present.
    extra_config: Callable[[ArchMetadata, dict, Mapping[str, np.ndarray]], dict] | None = None
    # (HF config key, metadata suffix) of the norm epsilon: RMSNorm families by default.
    norm_eps: tuple[str, str] = ("rms_norm_eps", "attention.layer_norm_rms_epsilon")
    # GGUF leaf.kind -> HF leaves under model.layers.N: a tensor the converter fused, cut back into
    # equal row blocks (qwen3next's ssm_ba into in_proj_b / in_proj_a)
    splits: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # GGUF leaf -> HF leaf of the MTP blocks' own tensors (blk.{n_layer}.. after the decoder, counted in
    # nextn_predict_layers): an architecture that has them loads those blocks (for `mtp` speculation),
    # every other one skips them.
    mtp_names: Mapping[str, str] = field(default_factory=dict)
    # GGUF leaf.kind of 3-D per-head weights [heads, out, in] kept packed (as one [heads * out, in] matrix) for a
    # per-head kernel: deepseek2's attn_k_b / attn_v_b, MLA's absorbed up-projections.
    head_stacks: frozenset[str] = frozenset()


def _llama_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """llama.cpp writes Mixtral as `llama` with experts (its expert size is feed_forward_length)."""
    experts = meta.integer("expert_count", 0)
    if not experts:
        return {}
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": experts,
            "num_experts_per_tok": meta.integer("expert_used_count")}


def _granite_moe_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """Granite-MoE's experts are feed_forward_length wide; llama.cpp renormalizes the top-k as HF does."""
    return {"num_local_experts": meta.integer("expert_count"), "num_experts_per_tok": meta.integer("expert_used_count")}


def _olmoe_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """OLMoE's experts are feed_forward_length wide; its converter writes no clip_qkv (llama.cpp never clamps)."""
    return {"num_experts": meta.integer("expert_count"), "num_experts_per_tok": meta.integer("expert_used_count")}


def _qwen_moe_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """Every llama.cpp qwen2moe / qwen3moe layer is sparse (no decoder_sparse_step, no mlp_only_layers)."""
    return {"num_experts": meta.integer("expert_count"), "num_experts_per_tok": meta.integer("expert_used_count"),
            "moe_intermediate_size": meta.integer("expert_feed_forward_length")}


def _gemma3_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """What llama.cpp hard-codes for Gemma 3 rather than storing: layer pattern, local rope base, query scale."""
    layers = config["num_hidden_layers"]
    pattern = meta.raw("attention.sliding_window_pattern", 6)
    if not config.get("sliding_window"):  # llama.cpp then attends fully everywhere
        sliding = [False] * layers
    elif isinstance(pattern, list):  # one flag per layer, true = sliding window
        if len(pattern) != layers:
            raise UnsupportedCheckpointError(
                f"GGUF {meta.key('attention.sliding_window_pattern')!r} has {len(pattern)} entries for {layers} layers")
        sliding = [bool(flag) for flag in pattern]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    else:
        raise UnsupportedCheckpointError(
            f"GGUF {meta.key('attention.sliding_window_pattern')!r} must be a layer count or per-layer flags")
    # llama.cpp scales queries by 1/sqrt(head_dim), except for the 62-layer (27B) model, which uses
    # hidden_size / heads; HF states the same as query_pre_attn_scalar.
    query_scalar = config["head_dim"]
    if layers == 62:
        query_scalar = config["hidden_size"] // config["num_attention_heads"]
    return {
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_local_base_freq": meta.number("rope.freq_base_swa", 10000.0),
        "query_pre_attn_scalar": query_scalar,
    }


def _gemma2_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """llama.cpp hard-codes Gemma 2's alternation (even layers slide) and its query scale: 1/sqrt(head_dim),
    except hidden / heads for the 46-layer (27B) model, as HF's query_pre_attn_scalar states."""
    layers = config["num_hidden_layers"]
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == 46 else config["head_dim"]
    return {"layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "query_pre_attn_scalar": scalar}


def partial_rotary(meta: ArchMetadata, config: dict) -> dict:
    """llama.cpp states the rotated width (rope.dimension_count); HF states a fraction of head_dim."""
    if not meta.has("rope.dimension_count"):
        return {}
    return {"partial_rotary_factor": meta.integer("rope.dimension_count") / config["head_dim"]}


def _phi_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    return partial_rotary(meta, config)


def _phi3_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """Sliding window 0 means none (Phi-4); LongRoPE comes as two factor tensors plus two keys."""
    extra = {**partial_rotary(meta, config), "sliding_window": meta.raw("attention.sliding_window") or None}
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if (long is None) != (short is None):
        raise UnsupportedCheckpointError("GGUF has only one of rope_factors_long / rope_factors_short")
    if long is not None:
        scaling = {"rope_type": "longrope", "long_factor": [float(x) for x in long.reshape(-1)],
                   "short_factor": [float(x) for x in short.reshape(-1)],
                   "original_max_position_embeddings": meta.integer("rope.scaling.original_context_length")}
        if meta.has("rope.scaling.attn_factor"):
            scaling["attention_factor"] = meta.number("rope.scaling.attn_factor")
        extra["rope_scaling"] = scaling
    return extra


def _stablelm_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    return {**partial_rotary(meta, config), "use_parallel_residual": bool(meta.raw("use_parallel_residual", True))}


def _sliding_layer_types(meta: ArchMetadata, config: dict) -> list[str]:
    """`attention.sliding_window_pattern` as one flag per layer (true = sliding); llama.cpp's default
    when absent: three sliding layers, then a full one."""
    layers = config["num_hidden_layers"]
    pattern = meta.raw("attention.sliding_window_pattern") or [(i + 1) % 4 != 0 for i in range(layers)]
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise UnsupportedCheckpointError(
            f"GGUF {meta.key('attention.sliding_window_pattern')!r} must list one flag for each of {layers} layers")
    return ["sliding_attention" if flag else "full_attention" for flag in pattern]


def _olmo2_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """OLMo 3 converts to llama.cpp's olmo2 architecture plus a sliding window and its per-layer pattern."""
    if not config.get("sliding_window"):
        return {}
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3",
            "layer_types": _sliding_layer_types(meta, config)}


def _exaone4_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """With a sliding window, EXAONE 4's local layers (rope) and global ones (NoPE) by the per-layer flags."""
    if not config.get("sliding_window"):
        return {}
    return {"layer_types": _sliding_layer_types(meta, config)}


def _cohere2_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """llama.cpp hard-codes Cohere 2's pattern: three sliding layers, then a global one (no rope)."""
    layers = config["num_hidden_layers"]
    return {**partial_rotary(meta, config),
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)]}


def _glm4_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    return partial_rotary(meta, config)


# DeepSeek-V2/V3's MLA projections and MoE; llama.cpp's newer converters split kv_b_proj into k_b (stored
# transposed, [heads, kv_lora_rank, nope]) and v_b, older ones keep it whole: both load.
DEEPSEEK2_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **MLP_NAMES, **MOE_NAMES,
    "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj", "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj", "attn_output": "self_attn.o_proj", "exp_probs_b": "mlp.gate.e_score_correction",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_EXPERT_GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE
# The MTP (nextn) block's own tensors as gguf-py names them (its decoder layer keeps the layer names).
NEXTN_NAMES = {"nextn.eh_proj": "eh_proj", "nextn.enorm": "enorm", "nextn.hnorm": "hnorm",
               "nextn.embed_tokens": "embed_tokens", "nextn.shared_head_head": "shared_head.head",
               "nextn.shared_head_norm": "shared_head.norm"}


def _deepseek2_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """DeepSeek-V2 / V3 / Kimi K2 and GLM-4.7-Flash as llama.cpp's converter states them. Its MLA-as-MQA keys (head_count_kv 1,
    key_length = kv_lora_rank + rope) come with key_length_mla / value_length_mla in newer files; older
    files state the per-head sizes as key_length / value_length. A correction bias (exp_probs_b) is V3's router."""
    rope = meta.integer("rope.dimension_count")
    key = meta.integer("attention.key_length_mla", None) or meta.integer("attention.key_length")
    value = meta.integer("attention.value_length_mla", None) or meta.integer("attention.value_length")
    gating = meta.integer("expert_gating_func", 1)
    if gating not in _EXPERT_GATING:
        raise UnsupportedCheckpointError(f"GGUF {meta.key('expert_gating_func')}={gating} is not supported; "
                                         f"supported: {', '.join(f'{k} ({v})' for k, v in _EXPERT_GATING.items())}")
    groups = meta.integer("expert_group_count", 1)
    biased = config.pop("e_score_correction_bias")
    nextn = meta.integer("nextn_predict_layers", 0)  # GLM-4.7-Flash's converter keeps its MTP block
    extra = {
        "num_hidden_layers": config["num_hidden_layers"] - nextn, "num_nextn_predict_layers": nextn,
        "num_key_value_heads": config["num_attention_heads"], "qk_rope_head_dim": rope,
        "qk_nope_head_dim": key - rope, "v_head_dim": value, "kv_lora_rank": meta.integer("attention.kv_lora_rank"),
        "q_lora_rank": meta.integer("attention.q_lora_rank", None),
        "first_k_dense_replace": meta.integer("leading_dense_block_count", 0),
        "n_routed_experts": meta.integer("expert_count"), "num_experts_per_tok": meta.integer("expert_used_count"),
        "moe_intermediate_size": meta.integer("expert_feed_forward_length"),
        "n_shared_experts": meta.integer("expert_shared_count", 0),
        "routed_scaling_factor": meta.number("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(meta.raw("expert_weights_norm", False)), "scoring_func": _EXPERT_GATING[gating],
        "n_group": groups, "topk_group": meta.integer("expert_group_used_count", groups),
        "topk_method": "noaux_tc" if biased else "group_limited_greedy" if groups > 1 else "greedy",
    }
    if biased:
        extra.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    return extra


# MiniCPM3's dense MLA layers under DeepSeek-V2's attention names.
MINICPM3_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **MLP_NAMES,
    **{leaf: DEEPSEEK2_LAYER_NAMES[leaf] for leaf in ("attn_q_a", "attn_q_a_norm", "attn_q_b", "attn_kv_a_mqa",
                                                       "attn_kv_a_norm", "attn_kv_b", "attn_output")},
}
# What llama.cpp hard-codes for MiniCPM3 rather than storing (llm_build_minicpm3).
MINICPM3_SCALES = {"scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 256}


def _minicpm3_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """The converter states key_length (nope + rope) and no value_length: llama.cpp's value head is then
    hidden_size / heads. LongRoPE comes as the two factor tensors, scaled from the training context."""
    rope = meta.integer("rope.dimension_count")
    value = meta.integer("attention.value_length", config["hidden_size"] // config["num_attention_heads"])
    extra = {"qk_rope_head_dim": rope, "qk_nope_head_dim": meta.integer("attention.key_length") - rope,
             "v_head_dim": value, "kv_lora_rank": meta.integer("attention.kv_lora_rank"),
             "q_lora_rank": meta.integer("attention.q_lora_rank", None)}
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if (long is None) != (short is None):
        raise UnsupportedCheckpointError("GGUF has only one of rope_factors_long / rope_factors_short")
    if long is not None:
        extra["rope_scaling"] = {"rope_type": "longrope", "long_factor": [float(x) for x in long.reshape(-1)],
                                 "short_factor": [float(x) for x in short.reshape(-1)],
                                 "original_max_position_embeddings": config["max_position_embeddings"]}
    return extra


# The sparse families whose shared experts and correction bias keep DeepSeek's HF names.
SHARED_EXPERTS_NAMES = {"ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
                        "ffn_down_shexp": "mlp.shared_experts.down_proj"}


def _ernie45_moe_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """ERNIE-4.5-MoE: llama.cpp's leading dense blocks and MoE interleave are HF's moe_layer_start_index and
    moe_layer_interval; its shared experts are moe_intermediate_size wide each."""
    return {"moe_num_experts": meta.integer("expert_count"), "moe_k": meta.integer("expert_used_count"),
            "moe_intermediate_size": meta.integer("expert_feed_forward_length"),
            "moe_num_shared_experts": meta.integer("expert_shared_count", 0),
            "moe_layer_start_index": meta.integer("leading_dense_block_count", 0),
            "moe_layer_interval": meta.integer("interleave_moe_layer_step", 1)}


def _glm4_moe_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """GLM-4.5: DeepSeek-V3's sigmoid, grouped, biased routing under llama.cpp's expert keys. The converter
    counts the MTP layers (nextn_predict_layers) in block_count: the decoder is the layers before them."""
    nextn = meta.integer("nextn_predict_layers", 0)
    groups = meta.integer("expert_group_count", 1)
    gating = meta.integer("expert_gating_func", 2)
    if _EXPERT_GATING.get(gating) != "sigmoid":
        raise UnsupportedCheckpointError(f"GGUF {meta.key('expert_gating_func')}={gating} is not supported for "
                                         f"{meta.arch}; supported: 2 (sigmoid)")
    return {**partial_rotary(meta, config), "num_hidden_layers": config["num_hidden_layers"] - nextn,
            "num_nextn_predict_layers": nextn, "n_routed_experts": meta.integer("expert_count"),
            "num_experts_per_tok": meta.integer("expert_used_count"),
            "moe_intermediate_size": meta.integer("expert_feed_forward_length"),
            "n_shared_experts": meta.integer("expert_shared_count", 0),
            "first_k_dense_replace": meta.integer("leading_dense_block_count", 0),
            "routed_scaling_factor": meta.number("expert_weights_scale", 1.0),
            "norm_topk_prob": bool(meta.raw("expert_weights_norm", False)),
            "n_group": groups, "topk_group": meta.integer("expert_group_used_count", groups)}


# What llama.cpp hard-codes for Llama 4 rather than storing: chunk size, NoPE step, temperature tuning.
LLAMA4_CHUNK, LLAMA4_NO_ROPE_STEP, LLAMA4_FLOOR_SCALE, LLAMA4_ATTN_SCALE = 8192, 4, 8192, 0.1


def _llama4_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """Llama 4 as llama.cpp runs it: rope + chunked attention on three layers of four, NoPE global on the
    fourth (a sliding window of 0: no chunks, only the last layer NoPE); L2 q/k norm except for the
    128-expert model (Maverick); feed_forward_length is the dense layers' width, the experts'
    expert_feed_forward_length."""
    layers = config["num_hidden_layers"]
    chunked = meta.raw("attention.sliding_window") != 0
    step = LLAMA4_NO_ROPE_STEP if chunked else layers
    rope = [(i + 1) % step != 0 for i in range(layers)]
    experts = meta.integer("expert_count")
    return {"num_local_experts": experts, "num_experts_per_tok": meta.integer("expert_used_count"),
            "intermediate_size": meta.integer("expert_feed_forward_length"),
            "intermediate_size_mlp": config["intermediate_size"],
            "interleave_moe_layer_step": meta.integer("interleave_moe_layer_step", 1),
            "no_rope_layers": [int(flag) for flag in rope], "attention_chunk_size": LLAMA4_CHUNK,
            "layer_types": ["chunked_attention" if flag and chunked else "full_attention" for flag in rope],
            "use_qk_norm": experts != 128, "attn_temperature_tuning": True, "floor_scale": LLAMA4_FLOOR_SCALE,
            "attn_scale": LLAMA4_ATTN_SCALE}


def _gpt_oss_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """gpt-oss as llama.cpp runs it: even layers slide, odd ones attend fully; SwiGLU clamped at 7 with
    alpha 1.702 (hard-coded there). Every gpt-oss checkpoint's YaRN is untruncated, which no key states."""
    layers = config["num_hidden_layers"]
    scaling = config["rope_scaling"]
    return {"num_local_experts": meta.integer("expert_count"), "num_experts_per_tok": meta.integer("expert_used_count"),
            "intermediate_size": meta.integer("expert_feed_forward_length"),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
            "rope_scaling": None if scaling is None else {**scaling, "truncate": False}}



ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(
        hf_architecture="LlamaForCausalLM",
        model_type="llama",
        layer_names={**LLAMA_LAYER_NAMES, **MOE_NAMES},
        config_constants={"hidden_act": "silu"},
        tensor_flags={"attention_bias": "attn_q.bias", "mlp_bias": "ffn_up.bias"},
        transforms=LLAMA_ROPE_UNPERMUTE,
        config_tensors=frozenset({"rope_freqs.weight"}),
        extra_config=_llama_config,
    ),
    "qwen2": ArchSpec(
        hf_architecture="Qwen2ForCausalLM",
        model_type="qwen2",
        layer_names=LLAMA_LAYER_NAMES,
        config_constants={"hidden_act": "silu"},
    ),
    "qwen3": ArchSpec(
        hf_architecture="Qwen3ForCausalLM",
        model_type="qwen3",
        layer_names={**LLAMA_LAYER_NAMES, **QK_NORM_NAMES},
        config_constants={"hidden_act": "silu"},
        tensor_flags={"attention_bias": "attn_q.bias"},
    ),
    # llama.cpp routes by softmax then top-k, renormalized for qwen3moe and not for qwen2moe.
    "qwen2moe": ArchSpec(
        hf_architecture="Qwen2MoeForCausalLM",
        model_type="qwen2_moe",
        layer_names={**LLAMA_LAYER_NAMES, **MOE_NAMES, **SHARED_EXPERT_NAMES},
        config_constants={"hidden_act": "silu", "norm_topk_prob": False},
        optional_keys={**OPTIONAL_KEYS, "shared_expert_intermediate_size": "expert_shared_feed_forward_length"},
        tensor_flags={"qkv_bias": "attn_q.bias"},
        transforms={"ffn_gate_inp_shexp.weight": AsRow()},
        extra_config=_qwen_moe_config,
    ),
    "qwen3moe": ArchSpec(
        hf_architecture="Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        layer_names={**LLAMA_LAYER_NAMES, **QK_NORM_NAMES, **MOE_NAMES},
        config_constants={"hidden_act": "silu", "norm_topk_prob": True},
        tensor_flags={"attention_bias": "attn_q.bias"},
        extra_config=_qwen_moe_config,
    ),
    "gemma3": ArchSpec(
        hf_architecture="Gemma3ForCausalLM",
        model_type="gemma3_text",
        layer_names=GEMMA_LAYER_NAMES,
        config_constants={"hidden_activation": "gelu_pytorch_tanh",
                          "final_logit_softcapping": None, "attn_logit_softcapping": None},
        optional_keys={**OPTIONAL_KEYS, "final_logit_softcapping": "final_logit_softcapping",
                       "attn_logit_softcapping": "attn_logit_softcapping"},
        head_dim_keys=("attention.key_length",),
        tensor_flags={"attention_bias": "attn_q.bias"},
        transforms=_norm_offsets(GEMMA_LAYER_NAMES),
        extra_config=_gemma3_config,
    ),
    "gemma": ArchSpec(
        hf_architecture="GemmaForCausalLM",
        model_type="gemma",
        layer_names=LLAMA_LAYER_NAMES,
        config_constants={"hidden_act": "gelu_pytorch_tanh"},
        head_dim_keys=("attention.key_length",),
        tensor_flags={"attention_bias": "attn_q.bias"},
        transforms=_norm_offsets(LLAMA_LAYER_NAMES),
    ),
    "gemma2": ArchSpec(
        hf_architecture="Gemma2ForCausalLM",
        model_type="gemma2",
        layer_names=GEMMA_LAYER_NAMES,
        # llama.cpp's defaults when the keys are absent
        config_constants={"hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0},
        optional_keys={**OPTIONAL_KEYS, "final_logit_softcapping": "final_logit_softcapping",
                       "attn_logit_softcapping": "attn_logit_softcapping"},
        head_dim_keys=("attention.key_length",),
        tensor_flags={"attention_bias": "attn_q.bias"},
        transforms=_norm_offsets(GEMMA_LAYER_NAMES),
        extra_config=_gemma2_config,
    ),
    "phi2": ArchSpec(
        hf_architecture="PhiForCausalLM",
        model_type="phi",
        layer_names={"attn_norm": "input_layernorm", **ATTENTION_NAMES, "attn_qkv": "self_attn.qkv_proj",
                     "attn_output": "self_attn.dense", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"},
        global_names={**GLOBAL_NAMES, "output_norm": "model.final_layernorm"},
        config_constants={"hidden_act": "gelu_new", "qk_layernorm": False},
        head_dim_keys=("attention.key_length",),
        norm_eps=LAYER_NORM_EPS,
        extra_config=_phi_config,
    ),
    "phi3": ArchSpec(
        hf_architecture="Phi3ForCausalLM",
        model_type="phi3",
        layer_names={**LLAMA_LAYER_NAMES, **FUSED_NAMES},
        config_constants={"hidden_act": "silu"},
        head_dim_keys=("attention.key_length",),
        config_tensors=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"}),
        extra_config=_phi3_config,
    ),
    "gpt2": ArchSpec(
        hf_architecture="GPT2LMHeadModel",
        model_type="gpt2",
        layer_names=GPT2_LAYER_NAMES,
        global_names={"token_embd": "model.embed_tokens", "position_embd": "model.embed_positions",
                      "output_norm": "model.norm", "output": "lm_head"},
        config_constants={"activation_function": "gelu_new"},
        head_dim_keys=(),
        norm_eps=("layer_norm_epsilon", "attention.layer_norm_epsilon"),
    ),
    "stablelm": ArchSpec(
        hf_architecture="StableLmForCausalLM",
        model_type="stablelm",
        layer_names=LAYERNORM_LLAMA_NAMES,
        config_constants={"hidden_act": "silu"},
        head_dim_keys=("attention.key_length",),
        tensor_flags={"use_qkv_bias": "attn_q.bias", "qk_layernorm": "attn_q_norm.weight"},
        norm_eps=LAYER_NORM_EPS,
        extra_config=_stablelm_config,
    ),
    "olmo2": ArchSpec(
        hf_architecture="Olmo2ForCausalLM",
        model_type="olmo2",
        layer_names={**ATTENTION_NAMES, **QK_NORM_NAMES, **MLP_NAMES,
                     "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
        config_constants={"hidden_act": "silu"},
        tensor_flags={"attention_bias": "attn_q.bias"},
        extra_config=_olmo2_config,
    ),
    "granite": ArchSpec(
        hf_architecture="GraniteForCausalLM",
        model_type="granite",
        layer_names=LLAMA_LAYER_NAMES,
        config_constants={"hidden_act": "silu"},
        optional_keys=GRANITE_SCALES,
        tensor_flags={"attention_bias": "attn_q.bias", "mlp_bias": "ffn_up.bias"},
        transforms=LLAMA_ROPE_UNPERMUTE,
    ),
    # Llama's layout; llama.cpp hard-codes a NoPE layer every 4th (n_no_rope_layer_step), stored nowhere.
    "smollm3": ArchSpec(
        hf_architecture="SmolLM3ForCausalLM",
        model_type="smollm3",
        layer_names=LLAMA_LAYER_NAMES,
        config_constants={"hidden_act": "silu", "no_rope_layer_interval": 4},
        tensor_flags={"attention_bias": "attn_q.bias", "mlp_bias": "ffn_up.bias"},
        transforms=LLAMA_ROPE_UNPERMUTE,
    ),
    # q/k RMSNorm over the whole projection; llama.cpp does not renormalize the top-k (norm_topk_prob off).
    "olmoe": ArchSpec(
        hf_architecture="OlmoeForCausalLM",
        model_type="olmoe",
        layer_names={**LLAMA_LAYER_NAMES, **QK_NORM_NAMES, **MOE_NAMES},
        config_constants={"hidden_act": "silu", "norm_topk_prob": False},
        tensor_flags={"attention_bias": "attn_q.bias"},
        extra_config=_olmoe_config,
    ),
    # The converter splits each layer's input_linear stack into ffn_gate_exps / ffn_up_exps.
    "granitemoe": ArchSpec(
        hf_architecture="GraniteMoeForCausalLM",
        model_type="granitemoe",
        layer_names={**LLAMA_LAYER_NAMES, **MOE_NAMES},
        config_constants={"hidden_act": "silu"},
        optional_keys=GRANITE_SCALES,
        tensor_flags={"attention_bias": "attn_q.bias"},
        transforms=LLAMA_ROPE_UNPERMUTE,
        extra_config=_granite_moe_config,
    ),
    "command-r": ArchSpec(
        hf_architecture="CohereForCausalLM",
        model_type="cohere",
        layer_names=LAYERNORM_LLAMA_NAMES,
        config_constants={"hidden_act": "silu"},
        optional_keys={"logit_scale": "logit_scale"},
        head_dim_keys=("attention.key_length",),
        tensor_flags={"attention_bias": "attn_q.bias", "use_qk_norm": "attn_q_norm.weight"},
        norm_eps=LAYER_NORM_EPS,
    ),
    "cohere2": ArchSpec(
        hf_architecture="Cohere2ForCausalLM",
        model_type="cohere2",
        layer_names=LLAMA_LAYER_NAMES,
        config_constants={"hidden_act": "silu"},
        optional_keys={**OPTIONAL_KEYS, "logit_scale": "logit_scale"},
        head_dim_keys=(),
        tensor_flags={"attention_bias": "attn_q.bias"},
        norm_eps=LAYER_NORM_EPS,
        extra_config=_cohere2_config,
    ),
    "glm4": ArchSpec(
        hf_architecture="Glm4ForCausalLM",
        model_type="glm4",
        # HF's names for GLM-4's four norms: post_attention_layernorm is the one before the MLP.
        layer_names={"attn_norm": "input_layernorm", **ATTENTION_NAMES, **FUSED_NAMES,
                     "post_attention_norm": "post_self_attn_layernorm", "ffn_norm": "post_attention_layernorm",
                     "ffn_down": "mlp.down_proj", "post_ffw_norm": "post_mlp_layernorm"},
        config_constants={"hidden_act": "silu"},
        head_dim_keys=("attention.key_length",),
        tensor_flags={"attention_bias": "attn_q.bias"},
        extra_config=_glm4_config,
    ),
    "deepseek2": ArchSpec(
        hf_architecture="DeepseekV2ForCausalLM",
        model_type="deepseek_v2",
        layer_names=DEEPSEEK2_LAYER_NAMES,
        config_constants={"hidden_act": "silu"},
        head_dim_keys=("rope.dimension_count",),  # transformers' head_dim: the rope part
        tensor_flags={"e_score_correction_bias": "exp_probs_b.bias"},  # read and dropped by _deepseek2_config
        extra_config=_deepseek2_config,
        mtp_names=NEXTN_NAMES,  # GLM-4.7-Flash's converter keeps its MTP block (DeepSeek-V3's drops it)
        head_stacks=frozenset({"attn_k_b.weight", "attn_v_b.weight"}),
    ),
    "minicpm3": ArchSpec(
        hf_architecture="MiniCPM3ForCausalLM",
        model_type="minicpm3",
        layer_names=MINICPM3_LAYER_NAMES,
        config_constants={"hidden_act": "silu", **MINICPM3_SCALES},
        head_dim_keys=("rope.dimension_count",),
        config_tensors=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"}),
        extra_config=_minicpm3_config,
    ),
    # Post-norms only (OLMo 2's block), per-head q/k norm; neox rope, so no row permutation.
    "exaone4": ArchSpec(
        hf_architecture="Exaone4ForCausalLM",
        model_type="exaone4",
        layer_names={**ATTENTION_NAMES, **QK_NORM_NAMES, **MLP_NAMES,
                     "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
        config_constants={"hidden_act": "silu"},
        head_dim_keys=("attention.key_length",),
        config_tensors=frozenset({"rope_freqs.weight"}),
        extra_config=_exaone4_config,
    ),
    # The converter names the pre-MLP norm post_attention_norm; o_proj's bias is its own switch.
    "seed_oss": ArchSpec(
        hf_architecture="SeedOssForCausalLM",
        model_type="seed_oss",
        layer_names={**LLAMA_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm"},
        config_constants={"hidden_act": "silu"},
        head_dim_keys=("attention.key_length",),
        tensor_flags={"attention_bias": "attn_q.bias", "attention_out_bias": "attn_output.bias"},
    ),
    # Interleaved rope in both HF and llama.cpp: no permutation. use_bias covers every projection.
    "ernie4_5-moe": ArchSpec(
        hf_architecture="Ernie4_5_MoeForCausalLM",
        model_type="ernie4_5_moe",
        layer_names={**LLAMA_LAYER_NAMES, **MOE_NAMES, **SHARED_EXPERTS_NAMES,
                     "exp_probs_b.bias": "mlp.moe_statics.e_score_correction_bias"},
        config_constants={"hidden_act": "silu"},
        tensor_flags={"use_bias": "attn_q.bias"},
        extra_config=_ernie45_moe_config,
    ),
    "glm4moe": ArchSpec(
        hf_architecture="Glm4MoeForCausalLM",
        model_type="glm4_moe",
        layer_names={**ATTENTION_NAMES, **QK_NORM_NAMES, **MLP_NAMES, **MOE_NAMES, **SHARED_EXPERTS_NAMES,
                     "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                     "exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},
        config_constants={"hidden_act": "silu"},
        head_dim_keys=("attention.key_length",),
        tensor_flags={"attention_bias": "attn_q.bias", "use_qk_norm": "attn_q_norm.weight"},
        extra_config=_glm4_moe_config,
        mtp_names=NEXTN_NAMES,
    ),
    # HF's feed_forward.* under Llama's GGUF names; interleaved rope already (the converter does not permute).
    "llama4": ArchSpec(
        hf_architecture="Llama4ForCausalLM",
        model_type="llama4_text",
        layer_names={**LLAMA_LAYER_NAMES, **MOE_NAMES, **SHARED_EXPERT_NAMES},
        config_constants={"hidden_act": "silu"},
        optional_keys={},
        config_tensors=frozenset({"rope_freqs.weight"}),
        extra_config=_llama4_config,
    ),
    # The converter splits gate_up_proj's interleaved rows (and bias) into ffn_gate_exps / ffn_up_exps
    # [E, I, H] (MXFP4 when the checkpoint's experts are), or with --fuse-gate-up-exps writes them as one
    # ffn_gate_up_exps [E, 2I, H], gate rows first; sinks are attn_sinks.weight.
    "gpt-oss": ArchSpec(
        hf_architecture="GptOssForCausalLM",
        model_type="gpt_oss",
        layer_names={**ATTENTION_NAMES, **MOE_NAMES, "attn_norm": "input_layernorm",
                     "post_attention_norm": "post_attention_layernorm", "attn_sinks.weight": "self_attn.sinks",
                     "ffn_gate_up_exps": "mlp.experts.gate_up_proj"},
        splits={f"ffn_gate_up_exps.{kind}": (f"mlp.experts.gate_proj.{kind}", f"mlp.experts.up_proj.{kind}")
                for kind in ("weight", "bias")},
        config_constants={"hidden_act": "silu"},
        head_dim_keys=("attention.key_length",),
        tensor_flags={"attention_bias": "attn_q.bias"},
        extra_config=_gpt_oss_config,
    ),
}

