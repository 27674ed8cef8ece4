"""An HF config.json-shaped dict from GGUF metadata and tensor shapes.

Keys follow HF's classic config.json (`rope_theta`, `rope_scaling`, Gemma 3's `rope_local_base_freq`),
which the model code reads alongside transformers 5's `rope_parameters`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.loader.gguf.archs import ArchSpec
from vllmpy.loader.gguf.metadata import ArchMetadata
from vllmpy.loader.gguf.rope import rope_scaling

# HF config key -> required `{arch}.` metadata suffix (integers).
REQUIRED_INT_KEYS = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "max_position_embeddings": "context_length",
}
# HF config key -> global tokenizer metadata key, set when present.
TOKEN_ID_KEYS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}
# llama.cpp's default when a file states no rope base.
DEFAULT_ROPE_THETA = 10000.0


def build_config(spec: ArchSpec, meta: ArchMetadata, shapes: Mapping[str, tuple[int, ...]],
                 rope_freqs: np.ndarray | None,
                 config_tensors: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
    """`shapes` maps every GGUF tensor name to its HF-order shape; `rope_freqs` is llama.cpp's rope tensor;
    `config_tensors` the values of the spec's other config tensors present in the file."""
    config: dict[str, Any] = {"architectures": [spec.hf_architecture], "model_type": spec.model_type}
    config.update(spec.config_constants)
    for hf_key, suffix in REQUIRED_INT_KEYS.items():
        if hf_key in config and not meta.has(suffix):  # the spec's constant stands in for a key it may omit
            continue
        config[hf_key] = _per_layer_max(meta, suffix, None)
    heads = config["num_attention_heads"]
    config["num_key_value_heads"] = _per_layer_max(meta, "attention.head_count_kv", heads)
    config["head_dim"] = _head_dim(spec, meta, config)
    eps_key, eps_suffix = spec.norm_eps
    config[eps_key] = meta.number(eps_suffix)
    config["vocab_size"] = _vocab_size(shapes)
    config["tie_word_embeddings"] = "output.weight" not in shapes
    config["rope_theta"] = meta.number("rope.freq_base", DEFAULT_ROPE_THETA)
    config["rope_scaling"] = rope_scaling(meta, config["head_dim"], config["rope_theta"], rope_freqs)
    for hf_key, key in TOKEN_ID_KEYS.items():
        if key in meta.metadata:
            config[hf_key] = meta.global_integer(key)
    for hf_key, suffix in spec.optional_keys.items():
        if meta.has(suffix):
            config[hf_key] = meta.metadata[meta.key(suffix)]
    for hf_key, leaf in spec.tensor_flags.items():
        config[hf_key] = any(name.startswith("blk.") and name.endswith(f".{leaf}") for name in shapes)
    if spec.extra_config is not None:
        config.update(spec.extra_config(meta, config, config_tensors or {}))
    return config


def _per_layer_max(meta: ArchMetadata, suffix: str, default: int | None) -> int:
    """An integer key, or the largest of its per-layer values: hybrids' converters state head_count_kv
    (0 on recurrent layers) and Nemotron-H's feed_forward_length (0 off the MLP layers) per layer."""
    per_layer = meta.raw(suffix)
    if isinstance(per_layer, list):
        return max(per_layer, default=0)
    return meta.integer(suffix) if default is None else meta.integer(suffix, default)


def _head_dim(spec: ArchSpec, meta: ArchMetadata, config: dict) -> int | None:
    for suffix in spec.head_dim_keys:
        if meta.has(suffix):
            return meta.integer(suffix)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if heads == 0 and not spec.head_dim_keys:  # attention-free (mamba2 states head_count 0)
        return None
    if heads <= 0 or hidden % heads:
        raise UnsupportedCheckpointError(
            f"GGUF states no head size ({', '.join(meta.key(s) for s in spec.head_dim_keys)}) and "
            f"hidden_size {hidden} is not a multiple of {heads} heads")
    return hidden // heads


def _vocab_size(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The embedding's row count: what the weights need, whatever the tokenizer list holds."""
    if "token_embd.weight" not in shapes:
        raise UnsupportedCheckpointError("GGUF has no token_embd.weight tensor (the token embedding)")
    return shapes["token_embd.weight"][0]
