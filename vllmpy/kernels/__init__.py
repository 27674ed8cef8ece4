"""CPU kernels that compute on GGML blocks (ggml_blocks.c), built for this machine on first use.

The C source ships in the package and is compiled once with the system C compiler into the cache
(`$VLLMPY_CACHE/kernels`, keyed by source, flags and CPU), then loaded with ctypes. Linking OpenMP
resolves to the libgomp torch already loaded, so the kernels and torch share one thread pool.
Where no compiler works, `block_kernels()` is None and callers keep the dequantize-at-load path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from vllmpy.loader.default_model import cache_dir

logger = logging.getLogger("vllmpy")

_SOURCE = Path(__file__).with_name("ggml_blocks.c")
_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-lm"]
_NATIVE = ["-march=native"]
_I64, _INT, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def _cpu_signature() -> str:
    """The CPU's feature flags: a library built with -march=native must not run on another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


def _compile(compiler: str, flags: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(_SOURCE), "-o", str(built)], check=True, capture_output=True, text=True)
        os.replace(built, target)  # atomic: concurrent processes never load a half-written library


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    errors = []
    for flags in (_FLAGS + _NATIVE, _FLAGS):
        key = hashlib.sha256("\0".join([_SOURCE.read_text(), compiler, *flags, _cpu_signature()]).encode())
        target = cache_dir() / "kernels" / f"ggml_blocks-{key.hexdigest()[:16]}.so"
        if target.exists():
            return target
        try:
            _compile(compiler, flags, target)
            return target
        except subprocess.CalledProcessError as exc:
            errors.append(exc.stderr.strip().splitlines()[-1] if exc.stderr.strip() else str(exc))
    raise RuntimeError(f"compiling {_SOURCE.name} failed: {errors[-1]}")


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.vq_block_layout.argtypes = [_INT, ctypes.POINTER(_INT), ctypes.POINTER(_INT)]
    lib.vq_block_layout.restype = _INT
    lib.vq_decode_rows.argtypes = [_INT, _PTR, _I64, _I64, _PTR, _I64, _PTR, _INT]
    lib.vq_decode_range.argtypes = [_INT, _PTR, _I64, _I64, _I64, _I64, _PTR, _INT]
    lib.vq_decode_range_bf16.argtypes = [_INT, _PTR, _I64, _I64, _I64, _I64, _PTR, _INT]
    lib.vq_matmul.argtypes = [_INT, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _INT]
    for fn in (lib.vq_decode_rows, lib.vq_decode_range, lib.vq_decode_range_bf16, lib.vq_matmul):
        fn.restype = None
    return lib


@functools.cache
def block_kernels() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (with a one-line notice) where it cannot be built."""
    try:
        torch.get_num_threads()  # make sure torch's OpenMP runtime is the one already loaded
        return _bind(ctypes.CDLL(str(_build())))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("quantized CPU kernels unavailable (%s); GGUF weights are dequantized at load", exc)
        return None


@functools.cache
def block_layout(ggml_type: int) -> tuple[int, int] | None:
    """(values, bytes) per block of a GGML type the kernels decode, else None."""
    lib = block_kernels()
    elems, size = _INT(), _INT()
    if lib is None or not lib.vq_block_layout(ggml_type, ctypes.byref(elems), ctypes.byref(size)):
        return None
    return elems.value, size.value
