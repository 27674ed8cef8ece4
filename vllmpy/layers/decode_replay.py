"""Decode steps of a layer stack replayed as the C kernel calls they make, without the Python around them.

At decode (every row one new token over its cached context) each layer's work on CPU is a fixed run of C
kernel calls on the same weights, the same KV cache and activations of the same shapes; only the values of
the step's inputs differ: the hidden state, cos/sin, slots, block tables and lengths. The Python around those
calls (module calls, checks, views, allocations, ctypes conversions: ~100 us a layer on Gemma 3 270M, more than
its layer-op kernels and attention together at batch 1) is the same every step.

A step is recorded by running the layers on buffers the plan owns (the step's inputs copied in) while every
call of the loaded kernel libraries (vllmpy/kernels LOADED_KERNELS) is logged with its arguments, and a torch
function mode keeps every tensor the step allocates alive and checks that torch itself computed nothing: only
allocations and ops whose outputs alias their inputs (views, no-op casts) may run, since a replay repeats the
kernel calls alone. A later step of the same shape copies its inputs into those buffers and repeats the logged
calls: the same kernels on the same addresses, so the results are bit-identical to running the modules, and
VLLMPY_PROFILE still times each call as its kernel. Where torch computes anything (LoRA deltas, tensor
parallel's all-reduce, residual adds in torch, a quantized KV cache's write, a bf16 model's casts) or a module
carries hooks, nothing is replayed and the modules run as always.

The layers' forward must be a function of its tensors (no Python state changed per step): true of the
decoder layers in vllmpy/models, whose per-step inputs all arrive through the metadata and position inputs.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from vllmpy import kernels
from vllmpy.attention.base import AttentionMetadata
from vllmpy.layers.rotary import CosSin

# Largest decode batch replayed: a plan holds every activation of its step (Gemma 3 270M: ~1 MiB a row).
MAX_ROWS = 32
MAX_PLAN_BYTES = 64 << 20  # a step whose activations outgrow this is not kept
MAX_PLANS = 2  # recorded shapes kept, the least recently replayed dropped first
_MIN_TABLE_COLUMNS = 64  # block-table width a plan's own tables start at (a power of two: outgrown, re-recorded)
_ALLOCATIONS = (torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty)
# Calls returning no tensor that read no values: a property's getter (shape, dtype, device), sizes, addresses.
_METADATA = frozenset(("__get__", "size", "stride", "dim", "numel", "nelement", "storage_offset", "data_ptr",
                       "is_contiguous", "untyped_storage", "element_size", "__len__", "is_floating_point",
                       "get_device"))
# Operators that write their left operand (in-place methods are the ones named with a trailing underscore).
_WRITES = frozenset(f"__{op}__" for op in ("setitem", "iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv",
                                           "imod", "ipow", "iand", "ior", "ixor", "ilshift", "irshift"))

# (hidden states, position inputs, KV caches, per-layer metadata) -> hidden states: the layer loop.
Layers = Callable[[torch.Tensor, dict, Sequence, Sequence], torch.Tensor]
# Where a step's input tensor lies in (hidden states, position inputs, per-layer metadata).
Source = Callable[[torch.Tensor, dict, Sequence], torch.Tensor]


@dataclass
class _Feed:
    """One owned input buffer and the tensor of each step copied into it (`narrow`: into its first columns,
    a block table as wide as this step's, the plan's as wide as its capacity). `aliases`: the other places
    that held the same tensor when the step was recorded (the batch tensors every group's metadata shares, a
    decode step's block table as its decode table), which a replayed step must share too."""

    buffer: torch.Tensor
    source: Source
    narrow: bool = False
    aliases: list[Source] = field(default_factory=list)


class _Feeds:
    """The owned copies of a step's inputs, one per distinct tensor."""

    def __init__(self) -> None:
        self.feeds: list[_Feed] = []
        self.by_tensor: dict[int, _Feed] = {}

    def owned(self, tensor: torch.Tensor, source: Source, columns: int | None = None) -> torch.Tensor:
        """The buffer fed from `source` (first seen holding `tensor`); `columns`: a block table that wide."""
        feed = self.by_tensor.get(id(tensor))
        if feed is not None:
            feed.aliases.append(source)
            return feed.buffer
        if columns is None:
            buffer = tensor.clone()
        else:
            buffer = tensor.new_zeros(tensor.shape[0], columns)
            buffer[:, :tensor.shape[1]] = tensor
        self.by_tensor[id(tensor)] = feed = _Feed(buffer, source, columns is not None)
        self.feeds.append(feed)
        return buffer


@dataclass
class _Plan:
    calls: list[tuple[Callable[..., object], tuple, object]]  # (kernel, arguments, what it returned)
    feeds: list[_Feed]
    out: torch.Tensor  # the layers' output, rewritten by each replay
    kv_caches: Sequence  # the caches the calls write (the runner's list, the same every step)
    held: list[object] = field(repr=False)  # every tensor of the recorded step: the addresses in `calls`

    def replay(self, x: torch.Tensor, inputs: dict, metas: Sequence) -> torch.Tensor | None:
        """The layers' output for this step, or None where its inputs are not laid out as recorded or a kernel
        answered otherwise (the small-batch matmul out of memory): the caller runs the modules then, which
        rewrite every KV slot a replay may have written."""
        for feed in self.feeds:
            source = feed.source(x, inputs, metas)
            if any(alias(x, inputs, metas) is not source for alias in feed.aliases):
                return None  # not laid out as recorded: one buffer cannot feed both
            (feed.buffer.narrow(1, 0, source.shape[1]) if feed.narrow else feed.buffer).copy_(source)
        for kernel, args, result in self.calls:
            if kernel(*args) != result:
                return None
        return self.out


class DecodeReplay:
    """The recorded decode steps of one layer stack, by shape (rows, table capacity, threads, layout)."""

    def __init__(self, layers: nn.Module) -> None:
        self.layers = layers  # the stack it records: for its hooks and LoRA
        self.enabled = True  # off: always the modules (the runner turns it off under --enable-lora)
        self.plans: OrderedDict[tuple, _Plan] = OrderedDict()
        self.refused: set[tuple] = set()  # shapes whose recording found torch compute: never retried
        self.last_key: tuple | None = None

    def run(self, layers: Layers, x: torch.Tensor, inputs: dict, kv_caches: Sequence,
            metas: Sequence) -> torch.Tensor:
        """layers(x, inputs, kv_caches, metas), replayed where this step's shape was recorded; a shape is
        recorded on its second step in a row (a batch size that holds), so changing batches cost nothing."""
        key = _step_key(x, inputs, metas) if self.enabled else None
        previous, self.last_key = self.last_key, key
        if key is None or key in self.refused:
            return layers(x, inputs, kv_caches, metas)
        plan = self.plans.get(key)
        if plan is not None and plan.kv_caches is kv_caches:
            self.plans.move_to_end(key)
            out = plan.replay(x, inputs, metas)
            if out is not None:
                return out
            del self.plans[key]
            return layers(x, inputs, kv_caches, metas)
        if key != previous:
            return layers(x, inputs, kv_caches, metas)
        plan, out = self._record(layers, x, inputs, kv_caches, metas, key[2])
        if plan is None:
            self.refused.add(key)
        else:
            self.plans[key] = plan
            while len(self.plans) > MAX_PLANS:
                self.plans.popitem(last=False)
        return out

    def _record(self, layers: Layers, x: torch.Tensor, inputs: dict, kv_caches: Sequence, metas: Sequence,
                columns: int) -> tuple[_Plan | None, torch.Tensor]:
        """Runs the step on owned copies of its inputs: (its plan, or None where it cannot be replayed; the
        layers' output, correct either way)."""
        feeds = _Feeds()
        owned_x = feeds.owned(x, lambda x, inputs, metas: x)
        owned_inputs = {kind: _owned_input(kind, value, feeds) for kind, value in inputs.items()}
        owned: dict[int, AttentionMetadata] = {}
        for layer, meta in enumerate(metas):
            if id(meta) not in owned:
                owned[id(meta)] = _owned_meta(layer, meta, columns, feeds)
        calls: list[tuple[Callable[..., object], tuple, object]] = []
        libraries = len(kernels.LOADED_KERNELS)
        with _logged_kernels(calls), _ViewsOnly() as mode:
            out = layers(owned_x, owned_inputs, kv_caches, [owned[id(meta)] for meta in metas])
        held_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                          for t in mode.held}.values())
        if (mode.computed or len(kernels.LOADED_KERNELS) != libraries or held_bytes > MAX_PLAN_BYTES
                or _runs_python_per_step(self.layers)):
            return None, out
        used = [feed for feed in feeds.feeds if _referenced(feed.buffer, calls)]
        return _Plan(calls, used, out, kv_caches, mode.held), out


def _step_key(x: torch.Tensor, inputs: dict, metas: Sequence) -> tuple | None:
    """What a plan is recorded for, or None for a step that is not an all-decode batch of up to MAX_ROWS rows
    (one token per sequence) on the CPU: rows, block-table capacity, threads, the layers' metadata layout."""
    rows = x.shape[0]
    if rows > MAX_ROWS or not x.is_cpu:
        return None
    groups: dict[int, int] = {}
    layout = []
    width = 0
    for meta in metas:
        group = groups.get(id(meta))
        if group is None:
            if (type(meta) is not AttentionMetadata or meta.prefill is not None or meta.decode is None
                    or meta.decode_index or meta.seq_lens.shape[0] != rows or meta.decode.token_idx.shape[0] != rows):
                return None
            group = groups[id(meta)] = len(groups)
            width = max(width, meta.block_tables.shape[1], meta.decode.tables.shape[1])
        layout.append(group)
    columns = max(_MIN_TABLE_COLUMNS, 1 << (width - 1).bit_length())
    return (rows, tuple(layout), columns, torch.get_num_threads(), x.dtype, tuple(inputs),
            torch.is_inference_mode_enabled())


def _owned_input(kind: str, value: object, feeds: _Feeds) -> object:
    """A position input (cos/sin, a temperature tensor) on owned buffers, fed from the step's `inputs[kind]`."""
    if isinstance(value, CosSin):
        return CosSin(feeds.owned(value.cos, lambda x, inputs, metas: inputs[kind].cos),
                      feeds.owned(value.sin, lambda x, inputs, metas: inputs[kind].sin), value.interleaved)
    if isinstance(value, torch.Tensor):
        return feeds.owned(value, lambda x, inputs, metas: inputs[kind])
    return value


def _owned_meta(layer: int, meta: AttentionMetadata, columns: int, feeds: _Feeds) -> AttentionMetadata:
    """meta (first read by `layer`) on owned tensors, its block tables `columns` wide."""
    decode = meta.decode
    return replace(
        meta, slot_mapping=feeds.owned(meta.slot_mapping, lambda x, i, metas: metas[layer].slot_mapping),
        block_tables=feeds.owned(meta.block_tables, lambda x, i, metas: metas[layer].block_tables, columns),
        query_start_loc=feeds.owned(meta.query_start_loc, lambda x, i, metas: metas[layer].query_start_loc),
        seq_lens=feeds.owned(meta.seq_lens, lambda x, i, metas: metas[layer].seq_lens),
        decode=replace(
            decode, token_idx=feeds.owned(decode.token_idx, lambda x, i, metas: metas[layer].decode.token_idx),
            rows=feeds.owned(decode.rows, lambda x, i, metas: metas[layer].decode.rows),
            seq_lens=feeds.owned(decode.seq_lens, lambda x, i, metas: metas[layer].decode.seq_lens),
            tables=feeds.owned(decode.tables, lambda x, i, metas: metas[layer].decode.tables, columns)))


def _referenced(buffer: torch.Tensor, calls: list[tuple[Callable[..., object], tuple, object]]) -> bool:
    """Whether some logged call takes an address inside buffer (an input nobody reads is not copied)."""
    low = buffer.data_ptr()
    high = low + buffer.untyped_storage().nbytes()
    return any(type(arg) is int and low <= arg < high for _, args, _ in calls for arg in args)


def _runs_python_per_step(layers: nn.Module) -> bool:
    """Whether the stack runs Python a replay would skip: hooks (tensor parallel's all-reduce) or LoRA deltas,
    which read the runner's per-step adapter mapping (adapters attach as requests name them, so the runner
    also turns replays off under --enable-lora)."""
    return any(module._forward_hooks or module._forward_pre_hooks or getattr(module, "lora", None) is not None
               for module in layers.modules())


@contextmanager
def _logged_kernels(calls: list[tuple[Callable[..., object], tuple, object]]) -> Iterator[None]:
    """Every call this thread makes to the loaded libraries' kernels appended to `calls` (the kernel as it was
    bound, a profiler's timer included, its arguments and result)."""
    owner, patched, seen = threading.get_ident(), [], set()
    for lib, names in list(kernels.LOADED_KERNELS):
        if id(lib) in seen:
            continue
        seen.add(id(lib))
        for name in names:
            kernel = getattr(lib, name)

            def logged(*args: object, _kernel: Callable[..., object] = kernel) -> object:
                result = _kernel(*args)
                if threading.get_ident() == owner:
                    calls.append((_kernel, args, result))
                return result
            setattr(lib, name, logged)
            patched.append((lib, name, kernel))
    try:
        yield
    finally:
        for lib, name, kernel in reversed(patched):
            setattr(lib, name, kernel)


class _ViewsOnly(TorchFunctionMode):
    """Holds every tensor torch makes while a step is recorded (until one computes), and names the first torch function that computed
    values (`computed`): anything but an allocation, a metadata query, or a function whose tensor outputs are
    all views of its inputs. A function mode, not a dispatch mode: entering torch's Python dispatch imports
    torch._dynamo (and sympy: ~70 MB, ~1 s) on first use, while a function mode sees the same calls one level up
    (a Python-composed op such as F.linear counts as its one call, and computes)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[torch.Tensor] = []
        self.computed: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.computed is None:
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if _views_or_allocates(func, args, kwargs, outputs):
                self.held += outputs
            else:  # no plan now: the step's tensors may go as the modules drop them
                self.computed = getattr(func, "__qualname__", str(func))
                self.held.clear()
        return out


def _views_or_allocates(func: Callable[..., object], args: tuple, kwargs: dict, outputs: list[torch.Tensor]) -> bool:
    """Whether the call left every value as it was and decided nothing from one: an allocation, a metadata query
    (shapes, strides, addresses: not values), or an op that writes no input (no trailing-underscore method, no
    out=, no item or in-place operator assignment) and whose every tensor output shares an input's storage."""
    name = getattr(func, "__name__", "")
    if func in _ALLOCATIONS:
        return True
    if not outputs:
        return name in _METADATA
    if (name.endswith("_") and not name.endswith("__")) or name in _WRITES or "out" in kwargs:
        return False
    storages = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    return all(t.untyped_storage().data_ptr() in storages for t in outputs)
