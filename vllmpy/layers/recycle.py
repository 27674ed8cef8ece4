"""Large per-step CPU results handed out again once nothing references them.

torch has no caching allocator on CPU, and glibc serves any allocation of 32 MiB or more (its largest
mmap threshold) as a fresh mapping whose every page faults on first touch: ~18 ms for the 67 MB of
logits of 64 rows x 262k vocabulary, more than computing them costs once the weights are decoded.
Each thread keeps one such buffer per dtype (and per inference mode: a tensor made under
torch.inference_mode cannot be written outside it) and reuses it while nobody else holds its storage.
"""
from __future__ import annotations

import threading

import torch

# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: anything smaller is recycled by malloc itself.
RECYCLE_MIN_BYTES = 32 << 20
# Storage reference count, private but stable since torch 2.0; without it nothing is recycled.
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
_buffers = threading.local()


def result_buffer(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous [rows, cols] CPU tensor; the caller owns it until it drops it."""
    numel = rows * cols
    if numel * dtype.itemsize < RECYCLE_MIN_BYTES or _storage_use_count is None:
        return torch.empty(rows, cols, dtype=dtype)
    held: dict[tuple[torch.dtype, bool], torch.Tensor] = _buffers.__dict__.setdefault("held", {})
    key = (dtype, torch.is_inference_mode_enabled())
    buffer = held.get(key)
    if buffer is not None and _in_use(buffer):
        return torch.empty(rows, cols, dtype=dtype)  # still someone's result: leave it with them
    if buffer is None or buffer.numel() < numel:
        buffer = held[key] = torch.empty(numel, dtype=dtype)
    return buffer[:numel].view(rows, cols)


def _in_use(buffer: torch.Tensor) -> bool:
    storage = buffer.untyped_storage()  # this wrapper holds one reference, `buffer` another
    return _storage_use_count(storage._cdata) > 2
