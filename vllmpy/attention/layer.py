"""The attention layer models call: it declares its KV cache spec and runs on the step's backend."""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from vllmpy.attention.base import AttentionMetadata, AttentionSpec
from vllmpy.engine.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


class PagedAttention(nn.Module):
    def __init__(self, spec: AttentionSpec, sinks: bool = False) -> None:
        """sinks: a learned [heads] logit per query head in every softmax denominator (gpt-oss's
        `self_attn.sinks`); the spec carries it to the backend at each forward."""
        super().__init__()
        self.spec = spec
        self.sinks = nn.Parameter(torch.empty(spec.num_heads), requires_grad=False) if sinks else None
        # An fp8 cache's per-tensor scales (stored = value / scale): the checkpoint's k_scale / v_scale
        # when it ships them (load_kv_scale), else 1.0. Other cache dtypes ignore them, as vLLM does.
        self.k_scale = self.v_scale = 1.0
        self.kv_scale_loaded = False

    def load_kv_scale(self, which: str, tensor: torch.Tensor) -> None:
        """A checkpoint's `k_scale`, `v_scale` or legacy `kv_scale` (both) scalar for this layer."""
        if tensor.numel() != 1:
            raise ValueError(f"{which} must be one per-tensor scalar, got shape {tuple(tensor.shape)}")
        value = float(tensor.reshape(()).float())
        if not value > 0:
            raise ValueError(f"{which} must be > 0, got {value}")
        if which in ("k_scale", "kv_scale"):
            self.k_scale = value
        if which in ("v_scale", "kv_scale"):
            self.v_scale = value
        self.kv_scale_loaded = True

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """A sliding layer keeps only its window's K/V; every other layer (encoders too) all positions'."""
        s = self.spec
        if s.sliding_window and s.causal:
            return SlidingWindowSpec(block_size, s.num_kv_heads, s.head_dim, dtype, s.sliding_window)
        return FullAttentionSpec(block_size, s.num_kv_heads, s.head_dim, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, heads, dim], k/v: [T, kv_heads, dim] -> [T, heads, dim]."""
        spec = self.spec if self.sinks is None else replace(self.spec, sinks=self.sinks)
        return meta.backend.forward(q, k, v, kv_cache, meta, spec)
