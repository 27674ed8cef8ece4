"""Hand freed heap memory back to the OS during and after loading."""
from __future__ import annotations

import ctypes
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


_M_ARENA_MAX = -8  # glibc's mallopt parameter


def one_malloc_arena() -> None:
    """Every thread allocates from glibc's main arena, for a one-shot process that wants a low peak: a thread's
    own arena (vllm-cli's tokenizer prefetch, OpenMP's workers) keeps pages of its own, ~20 MB of vllm-cli's
    peak RSS on the default model (588 vs 608 MB). Threads keep their tcache: small allocations take no lock."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_ARENA_MAX, 1)


def return_freed_heap() -> None:
    """glibc keeps freed allocations in its arenas: the transient heap of loading (tokenizer JSON, GGUF metadata
    lists, ~230 MB of RSS on the default model) and the holes that repacking a quantized weight leaves
    between the blocks kept (without trimming after each, ~40% more peak RSS on a GPTQ checkpoint)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
