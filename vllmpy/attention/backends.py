"""Attention backends: what runs a layer's paged attention, picked once per engine for its device.

A backend builds the step's metadata from the runner's layout, once per step (one per KV cache group,
the batch tensors shared; vLLM's AttentionMetadataBuilder), and runs every attention layer on it; the
metadata names the backend that built it, so a layer needs no global to find it. Adding a backend (a
CUDA one) adds a class and a name in BACKENDS. `VLLMPY_ATTENTION_BACKEND` overrides the choice.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch

from vllmpy.attention.base import (AttentionMetadata, AttentionSpec, DecodeBatch, DecodeIndex, DecodeView,
                                   GroupInputs, StepLayout)
from vllmpy.attention.kv_storage import PagedKVCache
from vllmpy.attention.metadata import BatchTensors
from vllmpy.attention.torch_paged import _attend_decode_rows, decode_index, paged_attention
from vllmpy.kernels import attention_kernels

BACKEND_ENV = "VLLMPY_ATTENTION_BACKEND"


class AttentionBackend(ABC):
    name: ClassVar[str]

    def build_metadata(self, layout: StepLayout, groups: Sequence[GroupInputs]) -> list[AttentionMetadata]:
        """Each group's metadata for this step, in `groups` order: the batch tensors built once for all."""
        if not groups:
            return []
        batch = BatchTensors.build(layout, groups[0].block_tables.device)
        metas = []
        for group in groups:
            decode = batch.decode_for(group)
            metas.append(AttentionMetadata(
                group.slot_mapping, group.block_tables, batch.query_start_loc, batch.seq_lens, layout.block_size,
                decode, batch.prefill, self,
                {} if decode is None else self.index_decode(decode, layout.block_size, group.views)))
        return metas

    def index_decode(self, decode: DecodeBatch, block_size: int,
                     views: frozenset[DecodeView]) -> Mapping[DecodeView, DecodeIndex]:
        """What this backend's decode reads per view of a group's layers, built with the metadata; the base
        builds nothing (the C kernel reads the block tables as they are)."""
        return {}

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        """Write this step's K/V into the layer's cache and attend: q [T, heads, dim] -> [T, heads, dim]."""

    def decode(self, q: torch.Tensor, kv_cache: PagedKVCache, meta: AttentionMetadata, spec: AttentionSpec,
               out: torch.Tensor) -> None:
        """Attention of meta's decode tokens only, over what the cache already holds (the layer wrote this
        step's entries): MLA's absorbed decode, MQA over the latent. q / out [B, heads, dim] hold just
        those tokens, in decode order (decode.rows)."""
        raise NotImplementedError(f"the {self.name} attention backend has no decode-only path (MLA layers)")

    @classmethod
    def supports(cls, device: torch.device) -> str | None:
        """None if the backend runs on `device`, else why not."""
        return None


class TorchAttentionBackend(AttentionBackend):
    """Portable: plain torch on any device, decode rows over a gathered copy of their blocks."""

    name = "torch"

    def index_decode(self, decode: DecodeBatch, block_size: int,
                     views: frozenset[DecodeView]) -> Mapping[DecodeView, DecodeIndex]:
        return {view: decode_index(decode, block_size, view) for view in views}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache, meta, spec, use_kernel=False)

    def decode(self, q, kv_cache, meta, spec, out) -> None:
        _attend_decode_rows(q, kv_cache, meta, spec, out, meta.decode.rows, use_kernel=False)


class CPUAttentionBackend(AttentionBackend):
    """The CPU's: decode rows through the C kernel reading the cache in place (the torch path for a
    cache it does not read), prefill rows as the torch backend."""

    name = "cpu"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache, meta, spec, use_kernel=True)

    def decode(self, q, kv_cache, meta, spec, out) -> None:
        _attend_decode_rows(q, kv_cache, meta, spec, out, meta.decode.rows, use_kernel=True)

    @classmethod
    def supports(cls, device: torch.device) -> str | None:
        if device.type != "cpu":
            return f"it runs on the CPU only, not on {device}"
        if attention_kernels() is None:
            return "its C kernel did not build here"
        return None


BACKENDS: dict[str, type[AttentionBackend]] = {
    backend.name: backend for backend in (CPUAttentionBackend, TorchAttentionBackend)}


def select_backend(device: torch.device) -> AttentionBackend:
    """VLLMPY_ATTENTION_BACKEND when set (refused where it cannot run), else the first in BACKENDS that
    supports the device."""
    requested = os.environ.get(BACKEND_ENV)
    if requested:
        if requested not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={requested!r} is not an attention backend; choose one of "
                             f"{', '.join(BACKENDS)}")
        reason = BACKENDS[requested].supports(device)
        if reason is not None:
            raise ValueError(f"{BACKEND_ENV}={requested}: {reason}; choose another of {', '.join(BACKENDS)}")
        return BACKENDS[requested]()
    return next(cls() for cls in BACKENDS.values() if cls.supports(device) is None)
