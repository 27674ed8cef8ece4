"""CPU kernels in C, built for this machine on first use: compute on GGML blocks (ggml_blocks.c; a few
activation rows of its fp8, zero-point and MXFP4 blocks in block_fma.c), decode attention read in place
from the paged KV cache (paged_attention.c), and RMSNorm / rotary / the gated MLP activation / the
sampler's row max and argmax in one call each (layer_ops.c), and the recurrent layers' decode updates on
their seats (recurrent_ops.c).

Each C source ships in the package and is compiled once with the system C compiler into the cache
(`$VLLMPY_CACHE/kernels`, keyed by source, flags and CPU), then loaded with ctypes. Linking OpenMP
resolves to the libgomp torch already loaded, so the kernels and torch share one thread pool.
Where no compiler works each accessor is None and callers keep their torch paths: GGUF weights are
dequantized at load, decode attention gathers the KV blocks, norms, rotary, gated activations, row
maxima and recurrent decode steps run as torch ops.
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
from collections.abc import Callable
from pathlib import Path

import torch

from vllmpy import profiling
from vllmpy.loader.default_model import cache_dir

logger = logging.getLogger("vllmpy")

_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-lm"]
_NATIVE = ["-march=native"]
_I64, _INT, _PTR, _FLOAT = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float


def _cpu_signature() -> str:
    """The CPU's feature flags: a library built with -march=native must not run on another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


def _compile(compiler: str, flags: list[str], source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(source), "-o", str(built)], check=True, capture_output=True, text=True)
        os.replace(built, target)  # atomic: concurrent processes never load a half-written library


def _source_text(source: Path) -> str:
    """The source and the headers beside it (half.h): a header edit must rebuild every library."""
    headers = sorted(source.parent.glob("*.h"))
    return "\0".join(path.read_text() for path in [source, *headers])


def _build(source: Path, flag_sets: tuple[list[str], ...] = (_FLAGS + _NATIVE, _FLAGS)) -> Path:
    """The cached library of `source` for this compiler and CPU, compiled if missing: the first of
    `flag_sets` that compiles (tests pass others to build the AVX2 and portable variants)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    errors = []
    for flags in flag_sets:
        key = hashlib.sha256("\0".join([_source_text(source), compiler, *flags, _cpu_signature()]).encode())
        target = cache_dir() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"
        if target.exists():
            return target
        try:
            _compile(compiler, flags, source, target)
            return target
        except subprocess.CalledProcessError as exc:
            errors.append(exc.stderr.strip().splitlines()[-1] if exc.stderr.strip() else str(exc))
    raise RuntimeError(f"compiling {source.name} failed: {errors[-1]}")


def _load(source: str, bind: Callable[[ctypes.CDLL], ctypes.CDLL], unavailable: str) -> ctypes.CDLL | None:
    """The bound library built from `source` (a file next to this module), or None after one warning
    line: `unavailable` with the reason in its %s, saying what callers do instead."""
    try:
        torch.get_num_threads()  # make sure torch's OpenMP runtime is the one already loaded
        return bind(ctypes.CDLL(str(_build(Path(__file__).with_name(source)))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning(unavailable, exc)
        return None


def _bind_blocks(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.vq_block_layout.argtypes = [_INT, ctypes.POINTER(_INT), ctypes.POINTER(_INT)]
    lib.vq_block_layout.restype = _INT
    lib.vq_decode_rows.argtypes = [_INT, _PTR, _I64, _I64, _PTR, _I64, _PTR, _INT]
    lib.vq_decode_range.argtypes = [_INT, _PTR, _I64, _I64, _I64, _I64, _PTR, _INT]
    lib.vq_decode_range_bf16.argtypes = [_INT, _PTR, _I64, _I64, _I64, _I64, _PTR, _INT]
    lib.vq_matmul.argtypes = [_INT, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _INT]
    lib.vq_transpose.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _INT]
    lib.vq_matmul_tiled.argtypes = [_INT, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _INT]
    lib.vq_matmul_tiled.restype = _INT
    lib.vq_matmul_small.argtypes = [_INT, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _INT]
    lib.vq_matmul_small.restype = _INT
    lib.vq_matmul_heads.argtypes = [_INT, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64,
                                    _INT]  # per-head y[h] = x[h] W[h]^T (MLA's absorbed up-projections)
    lib.vq_matmul_heads.restype = _INT
    lib.vq_matmul_experts.argtypes = [_PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _INT]
    lib.vq_matmul_experts.restype = _INT  # a MoE layer's decode rows of every active expert in one call
    lib.vq_matmul_small_amx.argtypes = [_INT]  # AMX tiles in the small-batch kernel: -1 asks, 0 / 1 sets
    lib.vq_matmul_small_amx.restype = _INT
    lib.vq_matmul_tiled_built.argtypes = []
    lib.vq_matmul_tiled_built.restype = _INT
    lib.vq_pool_fill.argtypes = [_INT, _I64, _PTR]  # the worker pool's self-check (tests)
    for fn in (lib.vq_decode_rows, lib.vq_decode_range, lib.vq_decode_range_bf16, lib.vq_matmul, lib.vq_transpose,
               lib.vq_pool_fill):
        fn.restype = None
    return lib


def _bind_attention(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.vq_paged_decode.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _INT, _FLOAT, _FLOAT, _PTR, _PTR, _PTR, _I64, _PTR,
                                    _I64, _I64, _I64, _I64, _I64, _FLOAT, _FLOAT, _I64, _PTR, _I64, _PTR, _I64, _INT]
    lib.vq_paged_decode.restype = _INT
    return lib


def _profiled(lib: ctypes.CDLL | None, kind: str, names: tuple[str, ...]) -> ctypes.CDLL | None:
    """lib, its calls `names` timed as `kind` under VLLMPY_PROFILE=1 (vllmpy/profiling.py), untouched otherwise."""
    if lib is not None and profiling.enabled():
        profiling.time_c_calls(lib, kind, names)
    return lib


@functools.cache
def block_kernels() -> ctypes.CDLL | None:
    """The GGML block kernel library, or None (with a one-line notice) where it cannot be built."""
    return _profiled(_load("ggml_blocks.c", _bind_blocks,
                           "quantized CPU kernels unavailable (%s); GGUF weights are dequantized at load"),
                     "packed matmul", ("vq_matmul", "vq_matmul_small", "vq_matmul_tiled", "vq_matmul_heads",
                                       "vq_matmul_experts", "vq_decode_rows", "vq_decode_range", "vq_decode_range_bf16",
                                       "vq_transpose"))


def _bind_block_fma(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.vq_block_fma_rows.argtypes = [_INT, ctypes.POINTER(_I64), ctypes.POINTER(_I64)]
    lib.vq_block_fma_rows.restype = _INT
    lib.vq_block_fma_matmul.argtypes = [_INT, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _INT]
    lib.vq_block_fma_matmul.restype = _INT
    return lib


@functools.cache
def block_fma_kernels() -> ctypes.CDLL | None:
    """The few-row matmul on the block types without vector decoders or small-batch panels in ggml_blocks.c
    (fp8 F8S, the zero-point blocks, MXFP4; block_fma.c), or None (with a one-line notice) where it cannot be
    built. Timed with the packed matmuls."""
    return _profiled(_load("block_fma.c", _bind_block_fma, "block FMA CPU kernel unavailable (%s); fp8, "
                           "zero-point and MXFP4 blocks keep the block library's paths"),
                     "packed matmul", ("vq_block_fma_matmul",))


@functools.cache
def block_fma_rows(ggml_type: int) -> range:
    """The activation-row counts block_fma.c takes for a block type (empty: unbuilt, or not its type)."""
    lib = block_fma_kernels()
    lo, hi = _I64(), _I64()
    if lib is None or not lib.vq_block_fma_rows(ggml_type, ctypes.byref(lo), ctypes.byref(hi)):
        return range(0)
    return range(lo.value, hi.value + 1)


@functools.cache
def attention_kernels() -> ctypes.CDLL | None:
    """The paged decode-attention library, or None (with a one-line notice) where it cannot be built."""
    return _profiled(_load("paged_attention.c", _bind_attention, "paged-attention CPU kernel unavailable (%s); "
                           "decode attention gathers the KV blocks in torch"),
                     "attention", ("vq_paged_decode",))


def _bind_layer_ops(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.vq_rms_norm.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _FLOAT, _INT]
    lib.vq_add_rms_norm.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _FLOAT, _INT]
    lib.vq_rope.argtypes = [_PTR, _I64, _PTR, _FLOAT, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT, _INT]
    lib.vq_row_max.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _INT]
    lib.vq_gated_act.argtypes = [_PTR, _PTR, _I64, _I64, _INT, _INT]
    lib.vq_sample_rows.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _INT]
    lib.vq_rms_norm_bf16.argtypes = [_PTR, _PTR, _INT, _PTR, _I64, _I64, _FLOAT, _INT]
    lib.vq_add_rms_norm_bf16.argtypes = [_PTR, _PTR, _PTR, _PTR, _INT, _PTR, _PTR, _I64, _I64, _FLOAT, _INT]
    lib.vq_rope_bf16.argtypes = [_PTR, _I64, _PTR, _INT, _FLOAT, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT, _INT]
    lib.vq_gated_act_bf16.argtypes = [_PTR, _PTR, _I64, _I64, _INT, _INT]
    for fn in (lib.vq_rms_norm, lib.vq_add_rms_norm, lib.vq_rope, lib.vq_row_max, lib.vq_gated_act,
               lib.vq_sample_rows, lib.vq_rms_norm_bf16, lib.vq_add_rms_norm_bf16, lib.vq_rope_bf16,
               lib.vq_gated_act_bf16):
        fn.restype = None
    return lib


@functools.cache
def layer_kernels() -> ctypes.CDLL | None:
    """RMSNorm, rotary, the gated activation, the sampler's row max and categorical draw in one call each,
    or None (with a one-line notice) where it cannot be built."""
    return _profiled(_load("layer_ops.c", _bind_layer_ops, "layer CPU kernels unavailable (%s); norms, rotary, "
                           "gated activations and row maxima run as torch ops"),
                     "layer ops", ("vq_rms_norm", "vq_add_rms_norm", "vq_rope", "vq_row_max",
                                    "vq_gated_act", "vq_sample_rows", "vq_rms_norm_bf16", "vq_add_rms_norm_bf16",
                                    "vq_rope_bf16", "vq_gated_act_bf16"))


def _bind_recurrent(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.vq_conv_update.argtypes = [_PTR, _I64, _PTR, _INT, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT, _INT]
    lib.vq_mamba2_step.argtypes = [_PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _INT, _PTR, _PTR,
                                   _I64, _I64, _I64, _I64, _I64, _INT]
    lib.vq_gated_delta_step.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _INT, _PTR, _PTR,
                                        _I64, _I64, _I64, _I64, _I64, _FLOAT, _INT]
    for fn in (lib.vq_conv_update, lib.vq_mamba2_step, lib.vq_gated_delta_step):
        fn.restype = None
    return lib


@functools.cache
def recurrent_kernels() -> ctypes.CDLL | None:
    """The recurrent layers' decode updates (conv window, Mamba2 SSM step, gated delta step) on their seats in
    place, or None (with a one-line notice) where it cannot be built. Timed with the layer ops."""
    return _profiled(_load("recurrent_ops.c", _bind_recurrent, "recurrent CPU kernels unavailable (%s); "
                           "recurrent decode steps run as torch ops"),
                     "layer ops", ("vq_conv_update", "vq_mamba2_step", "vq_gated_delta_step"))


@functools.cache
def block_layout(ggml_type: int) -> tuple[int, int] | None:
    """(values, bytes) per block of a GGML type the kernels decode, else None."""
    lib = block_kernels()
    elems, size = _INT(), _INT()
    if lib is None or not lib.vq_block_layout(ggml_type, ctypes.byref(elems), ctypes.byref(size)):
        return None
    return elems.value, size.value
