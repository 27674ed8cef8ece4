"""What every model family shares: the forward contract and weight loading by parameter name."""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from vllmpy.attention.base import AttentionMetadata
from vllmpy.attention.layer import PagedAttention
from vllmpy.engine.kv_cache_spec import KVCacheSpec
from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.linear import default_weight_loader
from vllmpy.layers.quantized import PackedTensor
from vllmpy.layers.recurrent_state import RecurrentStateSpec
from vllmpy.layers.rotary import RotaryEmbedding

# Checkpoint tensors that are derived buffers, never weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# An fp8 KV cache's per-layer scales as vLLM reads them: `self_attn.k_scale`, ModelOpt's
# `self_attn.k_proj.k_scale`, the legacy `self_attn.kv_scale` (both K and V).
_KV_SCALE = re.compile(r"^(?P<attn>.+?)\.(?:[kv]_proj\.)?(?P<which>k_scale|v_scale|kv_scale)$")


class CausalLM(nn.Module):
    """A decoder that runs one flat, mixed prefill/decode batch against a paged KV cache.

    Subclasses build `self.model` (embed_tokens, layers, norm) and `self.lm_head` from a config dict
    and map checkpoint names onto their fused parameters through `packed_modules_mapping`.
    """

    # checkpoint module name -> (our fused module name, shard id)
    packed_modules_mapping: dict[str, tuple[str, int | str]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    # (regex, replacement) pairs applied in order before packed_modules_mapping, for families whose
    # checkpoints name the shared blocks differently (`self_attn.dense` -> `self_attn.o_proj`).
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: list[AttentionMetadata]) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] of every token in the flat batch. kv_caches and
        meta hold one entry per layer, in kv_cache_specs() order (meta: the layer's group's)."""
        raise NotImplementedError

    def set_max_model_len(self, max_model_len: int) -> None:
        """The engine's serving length, given once after construction: LongRoPE picks its frequency set
        by it, a learned position table refuses a length it does not cover."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.set_serving_len(max_model_len)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype,
                       ssm_dtype: torch.dtype = torch.float32) -> list[KVCacheSpec | RecurrentStateSpec]:
        """What each layer keeps per request, in forward order (module order): an attention module's
        KV spec, or a recurrent layer's state spec (its SSM state in `ssm_dtype`)."""
        return [module.kv_cache_spec(block_size, dtype) if isinstance(module, PagedAttention)
                else module.recurrent_state_spec(ssm_dtype) for module in self.stateful_layers()]

    def stateful_layers(self) -> list[nn.Module]:
        """Attention modules and recurrent layers (those with `recurrent_state_spec`), in module order."""
        return [module for module in self.modules()
                if isinstance(module, PagedAttention) or hasattr(module, "recurrent_state_spec")]

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def checkpoint_name_to_param(self, name: str) -> tuple[str, int | str | None]:
        """Map a checkpoint tensor name to (our parameter name, shard id)."""
        for pattern, replacement in self.checkpoint_renames:
            name = re.sub(pattern, replacement, name)
        for ckpt_module, (fused, shard) in self.packed_modules_mapping.items():
            token = f".{ckpt_module}."
            if token in name:
                return name.replace(token, f".{fused}."), shard
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every checkpoint tensor into its parameter; refuse unknown or missing tensors by name."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            if ckpt_name.endswith(_IGNORED_SUFFIXES):
                continue
            if self.tie_word_embeddings and ckpt_name == "lm_head.weight":
                continue  # tied: the embedding is the head
            if self._load_kv_scale(ckpt_name, tensor):
                continue
            name, shard = self.checkpoint_name_to_param(ckpt_name)
            if name not in params:
                raise UnsupportedCheckpointError(
                    f"checkpoint tensor {ckpt_name!r} has no place in {type(self).__name__} "
                    f"(is a config key like tie_word_embeddings, attention_bias or qkv_bias wrong?)")
            param = params[name]
            module = self.get_submodule(name.rsplit(".", 1)[0])
            try:
                if hasattr(module, "tp_split"):  # tensor parallel: this rank's rows / columns (layers/parallel.py)
                    tensor = module.tp_split(name.rsplit(".", 1)[1], tensor, shard)
                if isinstance(tensor, PackedTensor):
                    if name.endswith(".weight") and hasattr(module, "load_packed"):
                        module.load_packed(tensor, shard)
                        loaded.add(name if shard is None else f"{name}#{shard}")
                        continue
                    tensor = tensor.dequantize()  # a module that only computes dense (norm tables, experts)
                loader = getattr(module, "weight_loader", None)
                if loader is None:
                    default_weight_loader(param, tensor.to(param.dtype))
                else:
                    loader(param, tensor.to(param.dtype), shard)
            except ValueError as exc:
                raise UnsupportedCheckpointError(f"checkpoint tensor {ckpt_name!r}: {exc}") from None
            loaded.add(name if shard is None else f"{name}#{shard}")
        self._check_all_loaded(params, loaded)
        self._finish_loading()

    def attention_layers(self) -> list[PagedAttention]:
        """The layers with a KV cache, in kv_cache_specs() order."""
        return [module for module in self.modules() if isinstance(module, PagedAttention)]

    def _load_kv_scale(self, ckpt_name: str, tensor: torch.Tensor | PackedTensor) -> bool:
        """Put a k_scale / v_scale / kv_scale tensor on its layer's PagedAttention; False for other tensors."""
        name = ckpt_name
        for pattern, replacement in self.checkpoint_renames:
            name = re.sub(pattern, replacement, name)
        match = _KV_SCALE.match(name)
        if match is None:
            return False
        try:
            owner = self.get_submodule(match["attn"])
        except AttributeError:
            return False
        attn = next((m for m in owner.modules() if isinstance(m, PagedAttention)), None)
        if attn is None:
            return False
        try:
            attn.load_kv_scale(match["which"], tensor.dequantize() if isinstance(tensor, PackedTensor) else tensor)
        except ValueError as exc:
            raise UnsupportedCheckpointError(f"checkpoint tensor {ckpt_name!r}: {exc}") from None
        return True

    def _finish_loading(self) -> None:
        """Per-module work once every tensor is in (fuse packed shards, precompute norm scales), and let a
        tied head compute on the embedding's packed table."""
        for module in self.modules():
            if hasattr(module, "finish_loading"):
                module.finish_loading()
        if self.tie_word_embeddings and hasattr(self, "lm_head"):
            self.lm_head.packed = getattr(self.model.embed_tokens, "packed", None)

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        for name, param in params.items():
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            if name in loaded:  # a fused tensor loaded whole (Phi-3's qkv_proj) fills every shard
                continue
            module = self.get_submodule(name.rsplit(".", 1)[0])
            shards = getattr(module, "shard_offsets", {None: None}).keys()
            for shard in shards:
                if (name if shard is None else f"{name}#{shard}") not in loaded:
                    missing = name if shard is None else f"{name} (shard {shard!r})"
                    raise UnsupportedCheckpointError(
                        f"checkpoint has no tensor for parameter {missing} of {type(self).__name__}")
