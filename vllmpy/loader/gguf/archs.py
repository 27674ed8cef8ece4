"""What differs between llama.cpp architectures, as data: supporting one more is one `ArchSpec` entry.

Names are llama.cpp's (`blk.N.attn_q.weight`) mapped to HF's (`model.layers.N.self_attn.q_proj.weight`)
by leaf; transforms are keyed by GGUF leaf and kind (`attn_q.weight`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.loader.gguf.metadata import ArchMetadata
from vllmpy.loader.gguf.transforms import SubtractOffset, Transform, UnpermuteRope

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

# HF config key -> `{arch}.` metadata suffix, read when present.
OPTIONAL_KEYS = {"sliding_window": "attention.sliding_window"}

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
    # Architecture-specific config keys derived from the metadata and the common config.
    extra_config: Callable[[ArchMetadata, dict], dict] | None = None


def _gemma3_config(meta: ArchMetadata, config: dict) -> dict:
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


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(
        hf_architecture="LlamaForCausalLM",
        model_type="llama",
        layer_names=LLAMA_LAYER_NAMES,
        config_constants={"hidden_act": "silu"},
        tensor_flags={"attention_bias": "attn_q.bias", "mlp_bias": "ffn_up.bias"},
        transforms=LLAMA_ROPE_UNPERMUTE,
        config_tensors=frozenset({"rope_freqs.weight"}),
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
}


def arch_spec(arch: Any) -> ArchSpec:
    if arch is None:
        raise UnsupportedCheckpointError("GGUF metadata key 'general.architecture' is required but missing")
    if arch not in ARCHS:
        raise UnsupportedCheckpointError(
            f"GGUF architecture {arch!r} (general.architecture) is not supported; "
            f"supported: {', '.join(sorted(ARCHS))}")
    return ARCHS[arch]
