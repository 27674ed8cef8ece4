"""What each layer keeps per request (its cache spec), and how layers with equal specs form KV cache groups.

A layer declares a small frozen spec; layers with equal specs share a group and a group has one block
table per request. Every group has the same number of layers, so one pool block is one page in each of
`layers_per_group` shared tensors whichever group holds it: all groups draw on one block pool and one
byte budget (vLLM's hybrid allocator). A new kind of state adds a spec here and a manager in
kv_cache_managers.py; the scheduler only talks to the coordinator and never sees the kind.

Recurrent layers (layers/recurrent_state.py) hold no blocks: each running request owns one seat, an index
into every recurrent layer's fixed-size state tensors, sized out of the same byte budget (runner/memory.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

from vllmpy.attention.kv_storage import PagedKVCache, element_bytes
from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.recurrent_state import RecurrentStateSpec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheSpec(ABC):
    """The state one layer keeps per request, in blocks of `block_size` token positions."""

    block_size: int

    @property
    @abstractmethod
    def page_bytes(self) -> int:
        """Bytes of one block of one layer."""

    @abstractmethod
    def max_blocks(self, max_model_len: int, max_chunk: int) -> int:
        """Most blocks one request can hold at once, when steps compute up to `max_chunk` tokens of it."""

    @abstractmethod
    def view(self, buffer: torch.Tensor, num_blocks: int) -> PagedKVCache | torch.Tensor:
        """This layer's cache over a byte buffer of num_blocks pages (an attention layer's: PagedKVCache)."""

    @property
    def label(self) -> str:
        """How the INFO line names this kind."""
        return type(self).__name__

    def held_as(self, max_model_len: int) -> KVCacheSpec:
        """The spec this layer's blocks behave as at this serving length (groups form over it)."""
        return self


@dataclass(frozen=True)
class AttentionCacheSpec(KVCacheSpec, ABC):
    """K and V of every cached position: [2, num_blocks, block_size, num_kv_heads, head_dim] in the storage
    dtype (--kv-cache-dtype; attention/kv_storage.py: an int8 cache adds its scales)."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        values = 2 * self.block_size * self.num_kv_heads * self.head_dim
        return round(values * element_bytes(self.dtype, self.head_dim))

    def view(self, buffer: torch.Tensor, num_blocks: int) -> PagedKVCache:
        return PagedKVCache.over_buffer(buffer, self.dtype, num_blocks, self.block_size, self.num_kv_heads,
                                        self.head_dim)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionCacheSpec):
    """Every position stays visible: a request holds blocks for all of its tokens."""

    @property
    def label(self) -> str:
        return "full attention"

    def max_blocks(self, max_model_len: int, max_chunk: int) -> int:
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionCacheSpec):
    """A query at position q sees keys in (q - sliding_window, q]: blocks wholly before the oldest
    position any future query can see go back to the pool."""

    sliding_window: int

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def label(self) -> str:
        return f"sliding window {self.sliding_window}"

    def max_blocks(self, max_model_len: int, max_chunk: int) -> int:
        # A chunk's first query still sees window - 1 older keys; the window's start may cut a block.
        held = cdiv(self.sliding_window - 1 + min(max_chunk, max_model_len), self.block_size) + 1
        return min(held, cdiv(max_model_len, self.block_size))

    def held_as(self, max_model_len: int) -> KVCacheSpec:
        """A window as long as the context frees nothing: it groups with full attention."""
        if self.sliding_window < max_model_len:
            return self
        return FullAttentionSpec(self.block_size, self.num_kv_heads, self.head_dim, self.dtype)


@dataclass(frozen=True)
class KVCacheGroup:
    spec: KVCacheSpec
    layers: tuple[int, ...]  # indices into the model's per-layer cache list (its forward order)


@dataclass(frozen=True)
class KVCacheLayout:
    """The groups and the shared tensors they index: layer `i` of every group lives in tensor `i`."""

    groups: tuple[KVCacheGroup, ...]
    # (layer index, spec) of every recurrent layer: a request's one seat indexes all of their states
    recurrent: tuple[tuple[int, RecurrentStateSpec], ...] = ()

    @classmethod
    def from_specs(cls, specs: Sequence[KVCacheSpec | RecurrentStateSpec], max_model_len: int) -> KVCacheLayout:
        """Group equal specs, then cut every group to the smallest one's layer count so all groups
        span the same tensors (a spec's last group may come up short: its missing slots stay unused,
        as vLLM pads). Equal-sized groups are what let one block id mean one page per tensor.
        Recurrent layers stand apart: they hold seats, not blocks."""
        if not specs:
            raise ValueError("a model needs at least one layer with a KV cache")
        recurrent = tuple((i, spec) for i, spec in enumerate(specs) if isinstance(spec, RecurrentStateSpec))
        by_spec: dict[KVCacheSpec, list[int]] = {}
        for index, spec in enumerate(specs):
            if not isinstance(spec, RecurrentStateSpec):
                by_spec.setdefault(spec.held_as(max_model_len), []).append(index)
        if not by_spec:  # a model of recurrent layers only (Mamba2)
            return cls((), recurrent)
        pages = {spec.page_bytes for spec in by_spec}
        if len(pages) > 1:
            kinds = ", ".join(f"{s.label}: layers {v[0]}.. ({s.page_bytes} B/block)" for s, v in by_spec.items())
            raise UnsupportedCheckpointError(
                f"layers whose KV blocks differ in size cannot share one pool yet ({kinds}); every layer "
                f"must have the same KV heads, head_dim and cache dtype")
        size = min(len(layers) for layers in by_spec.values())
        return cls(tuple(KVCacheGroup(spec, tuple(layers[start:start + size]))
                         for spec, layers in by_spec.items() for start in range(0, len(layers), size)), recurrent)

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size if self.groups else 1  # no attention: blocks are never used

    @property
    def layers_per_group(self) -> int:
        """The number of shared tensors, each holding one page of every block."""
        return max((len(group.layers) for group in self.groups), default=0)

    @property
    def num_layers(self) -> int:
        """Every stateful layer: attention layers of all groups and recurrent ones."""
        return sum(len(group.layers) for group in self.groups) + len(self.recurrent)

    @property
    def page_bytes(self) -> int:
        return self.groups[0].spec.page_bytes if self.groups else 0

    @property
    def state_bytes_per_seq(self) -> int:
        """Bytes of one seat: every recurrent layer's state for one sequence."""
        return sum(spec.bytes_per_seq for _, spec in self.recurrent)

    @property
    def block_bytes(self) -> int:
        """Bytes one pool block costs: a page in every shared tensor."""
        return self.page_bytes * self.layers_per_group

    def blocks_per_request(self, max_model_len: int, max_chunk: int) -> int:
        """Blocks a lone request of max_model_len tokens can hold at once, across all groups."""
        return sum(group.spec.max_blocks(max_model_len, max_chunk) for group in self.groups)

    def longest_fitting_len(self, num_blocks: int, max_chunk: int, upper: int) -> int:
        """The longest max_model_len up to `upper` whose lone request fits in num_blocks (0 if none)."""
        low, high = 0, upper  # blocks_per_request grows with the length, so bisect
        while low < high:
            mid = (low + high + 1) // 2
            if self.blocks_per_request(mid, max_chunk) <= num_blocks:
                low = mid
            else:
                high = mid - 1
        return low

    def describe(self, max_model_len: int, max_chunk: int) -> str:
        """Per kind: its groups, layers per group and the blocks one max_model_len request holds in each."""
        counts: dict[KVCacheSpec, int] = {}
        for group in self.groups:
            counts[group.spec] = counts.get(group.spec, 0) + 1
        kinds = ", ".join(f"{spec.label} x{n} (up to {spec.max_blocks(max_model_len, max_chunk)} blocks/seq each)"
                          for spec, n in counts.items())
        text = f"{len(self.groups)} group(s) of {self.layers_per_group} layer(s): {kinds}" if self.groups else \
            "no attention layers"
        if self.recurrent:
            text += (f"; {len(self.recurrent)} {self.recurrent[0][1].label} layer(s) with "
                     f"{self.state_bytes_per_seq} B of state per sequence")
        return text


@dataclass(frozen=True)
class KVCacheConfig:
    """The sized pool: num_blocks blocks over `layout`'s tensors."""

    num_blocks: int
    layout: KVCacheLayout
    num_seats: int = 0  # recurrent-state seats (the most running requests); 0 without recurrent layers
    num_snapshots: int = 0  # recurrent-state prefix-cache snapshot slots (engine/recurrent_snapshots.py)

    @property
    def groups(self) -> tuple[KVCacheGroup, ...]:
        return self.layout.groups

    @property
    def block_size(self) -> int:
        return self.layout.block_size
