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


def _llama_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """llama.cpp writes Mixtral as `llama` with experts (its expert size is feed_forward_length)."""
    experts = meta.integer("expert_count", 0)
    if not experts:
        return {}
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": experts,
            "num_experts_per_tok": meta.integer("expert_used_count")}


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


def _partial_rotary(meta: ArchMetadata, config: dict) -> dict:
    """llama.cpp states the rotated width (rope.dimension_count); HF states a fraction of head_dim."""
    if not meta.has("rope.dimension_count"):
        return {}
    return {"partial_rotary_factor": meta.integer("rope.dimension_count") / config["head_dim"]}


def _phi_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    return _partial_rotary(meta, config)


def _phi3_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """Sliding window 0 means none (Phi-4); LongRoPE comes as two factor tensors plus two keys."""
    extra = {**_partial_rotary(meta, config), "sliding_window": meta.raw("attention.sliding_window") or None}
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
    return {**_partial_rotary(meta, config), "use_parallel_residual": bool(meta.raw("use_parallel_residual", True))}


def _olmo2_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """OLMo 3 converts to llama.cpp's olmo2 architecture plus a sliding window and its per-layer pattern."""
    if not config.get("sliding_window"):
        return {}
    layers = config["num_hidden_layers"]
    pattern = meta.raw("attention.sliding_window_pattern") or [(i + 1) % 4 != 0 for i in range(layers)]
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise UnsupportedCheckpointError(
            f"GGUF {meta.key('attention.sliding_window_pattern')!r} must list one flag for each of {layers} layers")
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3",
            "layer_types": ["sliding_attention" if flag else "full_attention" for flag in pattern]}


def _cohere2_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    """llama.cpp hard-codes Cohere 2's pattern: three sliding layers, then a global one (no rope)."""
    layers = config["num_hidden_layers"]
    return {**_partial_rotary(meta, config),
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)]}


def _glm4_config(meta: ArchMetadata, config: dict, tensors: Mapping[str, np.ndarray]) -> dict:
    return _partial_rotary(meta, config)


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
        optional_keys={"attention_multiplier": "attention.scale", "embedding_multiplier": "embedding_scale",
                       "residual_multiplier": "residual_scale", "logits_scaling": "logit_scale"},
        tensor_flags={"attention_bias": "attn_q.bias", "mlp_bias": "ffn_up.bias"},
        transforms=LLAMA_ROPE_UNPERMUTE,
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
}


def arch_spec(arch: Any) -> ArchSpec:
    if arch is None:
        raise UnsupportedCheckpointError("GGUF metadata key 'general.architecture' is required but missing")
    if arch not in ARCHS:
        raise UnsupportedCheckpointError(
            f"GGUF architecture {arch!r} (general.architecture) is not supported; "
            f"supported: {', '.join(sorted(ARCHS))}")
    return ARCHS[arch]
