"""GGML-quantized weights kept packed, and the linear / embedding math on them.

A `PackedTensor` is a 2-D weight as the GGUF file stores it: each row a run of whole blocks. A
few activation rows (decode) go through the C kernel, which reads every block once for the whole
batch; 4 to 32 rows through the small-batch C kernel, which decodes each thread's weight rows once into
int16 panels and multiplies them by x rounded to int16 (VNNI dot products; on CPUs with AMX-INT8, tile
multiplies on x split exactly into bytes, bit-identical to the panels); a batch of up to 128 rows goes
through the C tiled kernel (AVX-512), which decodes each thread's weight rows into cache and multiplies
them there; more rows (prefill), or CPUs without that kernel, decode
the weight into a scratch buffer (whole, or slab by slab when it is large) and hand it to the dense matmul
(`dense_linear`), where the arithmetic dominates. The block types ggml_blocks.c has no vector decoder or
panels for (fp8 F8S, the zero-point Q4Z / Q8Z / Q4ZF / Q8ZF, MXFP4) first try kernels/block_fma.c for the row
counts it takes (`block_fma_rows`: up to 24 with AVX-512), which decodes each block into float registers once
for up to 8 rows.
"""
from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllmpy.kernels import block_fma_kernels, block_fma_rows, block_kernels, block_layout
from vllmpy.layers.dense import dense_linear
from vllmpy.layers.recycle import result_buffer

# Up to this many activation rows the block kernel wins (for the block types the small-batch kernel lacks;
# the others from SMALL_MIN_ROWS on); above it, decode + dense matmul (default model,
# 2 AVX-512 cores, median decode step: 39.7 vs 46.9 ms at 9 rows, 42.8 vs 44.1 at 10, 47.8 vs 45.2 at 11).
KERNEL_MAX_ROWS = 10
# From this many rows to SMALL_MAX_ROWS the small-batch kernel (int16 panels over weight rows; AMX tiles inside it
# where the CPU has them, from 4 rows for Q8_0 and 9 for the others, ggml_blocks.c AMX_MIN_ROWS) wins over both
# (benchmarks/kernels.py, default model's layer-0 weights, 1 thread, medians of 20 interleaved rounds, the
# other kernel's time over its: Q5_0 1024 x 640 at 2 / 4 / 16 / 32 rows: integer row dots 0.96 / 1.45 / 3.20 /
# 4.04x, tiled 2.71 / 2.46 / 1.39 / 1.26x; Q6_K 640 x 2048: row dots 0.82 / 1.19 / 2.78 / 3.93x, tiled 2.18 /
# 2.05 / 1.24 / 1.08x).
SMALL_MIN_ROWS, SMALL_MAX_ROWS = 4, 32
# Most values decoded at once (4 MiB of float32): a layer's weight up to this is one matmul whose result is
# returned as is; a larger one goes in slabs of a power-of-two row count, which oneDNN multiplies ~6% faster
# than odd counts (64 x 262k x 640 head: 58 vs 62 ms). 16 MiB slabs (the scratch, oneDNN's copy of each slab
# and the slab's product) kept ~10% of an int4 0.5B model's file more RSS through a 256-token prefill at no
# speed gain there (benchmarks/quantized_formats.py: GPTQ asym 1.36 -> 1.26x the file, prefill 1.04x); at
# 11-128 rows on builds without the tiled kernel 4 MiB slabs cost ~0.9 ms more per layer at 64 rows.
_SLAB_FLOATS = 1 << 20
# Up to this many activation rows the decoded weight is the matmul's first operand (`_transposed`).
_TRANSPOSED_MAX_ROWS = 128
_scratch = threading.local()


@dataclass
class PackedTensor:
    """A [rows, cols] weight in GGML blocks: `data` is uint8 [rows, bytes per row], often a file view.

    `input_perm` (GPTQ act-order, repacked so each group's columns are contiguous): the blocks hold the
    weight's columns in this order, so the matmul permutes the activation's columns the same way."""

    data: torch.Tensor
    ggml_type: int
    shape: tuple[int, int]
    input_perm: torch.Tensor | None = None

    @staticmethod
    def packable(ggml_type: int, shape: tuple[int, ...]) -> bool:
        """A 2-D tensor whose rows are whole blocks of a type the kernels decode."""
        layout = block_layout(ggml_type)
        return layout is not None and len(shape) == 2 and shape[1] % layout[0] == 0

    @staticmethod
    def from_numpy(rows: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> PackedTensor:
        """Wrap the file's bytes without copying; torch warns about the read-only mapping, which is never written."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(rows.view(np.uint8).reshape(shape[0], -1))
        return PackedTensor(data, ggml_type, shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @functools.cached_property
    def kernel_args(self) -> tuple[int, int, int, int, int]:
        """(block type, address, bytes per row, rows, cols): what every matmul kernel takes first, read once
        (a weight's bytes never move; at decode the five lookups cost ~1 us a call)."""
        return self.ggml_type, self.data.data_ptr(), self.data.shape[1], self.shape[0], self.shape[1]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows at `ids` (any shape), bit-identical to gguf's dequantize of those rows."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), self.shape[1], dtype=torch.float32)
        block_kernels().vq_decode_rows(self.ggml_type, self.data.data_ptr(), self.data.shape[1], self.shape[1],
                                       flat.data_ptr(), flat.numel(), out.data_ptr(), torch.get_num_threads())
        if self.input_perm is not None:
            out = torch.empty_like(out).index_copy_(1, self.input_perm, out)
        return out.reshape(*ids.shape, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.shape[0]))

    def fuses_with(self, other: PackedTensor) -> bool:
        """Whether `concat` may stack the two: one block type and one column order."""
        if self.ggml_type != other.ggml_type or (self.input_perm is None) != (other.input_perm is None):
            return False
        return self.input_perm is None or torch.equal(self.input_perm, other.input_perm)

    def concat(self, other: PackedTensor) -> PackedTensor:
        """Rows of `other` appended (`fuses_with`): fused q/k/v or gate/up in one weight."""
        data = torch.cat([self.data, other.data])
        return PackedTensor(data, self.ggml_type, (self.shape[0] + other.shape[0], self.shape[1]), self.input_perm)


def packed_linear(x: torch.Tensor, weight: PackedTensor | Sequence[PackedTensor],
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ b) with W packed, result in x's dtype; W may be a run of segments stacked along the
    output (fused q/k/v of different block types), each written into its columns of one result.

    Few rows: float32 in the block kernel; 4 to 32 rows in the small-batch kernel (x rounded to int16 per
    32-value block: error <= 2^-14 of the block's largest |x| per value). Up to 128 float32 rows: the tiled
    kernel where built (AVX-512).
    Else slabs in float32, or in bfloat16 when x is (the user chose --dtype bfloat16: CPUs with
    AVX512-BF16 or AMX multiply it natively, ~4x faster)."""
    if isinstance(weight, PackedTensor):  # one weight (fused ones too): no generator per call (~1.5 us at decode)
        segments, n, permuted = (weight,), weight.shape[0], weight.input_perm is not None
    else:
        segments, n = weight, sum(segment.shape[0] for segment in weight)
        permuted = any(segment.input_perm is not None for segment in weight)
    if permuted:
        return _permuted_linear(x, segments, bias)
    flat = x.dim() == 2  # the engine's [tokens, hidden]: no reshape, view or cast (~10 us a call at decode)
    x2 = x if flat else x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    y = None
    if rows in block_fma_rows(segments[0].ggml_type):  # fp8, zero points, MXFP4 (declined for other segments)
        y = _by_segment(block_fma_kernels().vq_block_fma_matmul, x2.float().contiguous(), segments,
                        torch.empty(rows, n))
    if y is None and SMALL_MIN_ROWS <= rows <= SMALL_MAX_ROWS:  # declined (None) for types without its panels
        y = _by_segment(block_kernels().vq_matmul_small, x2.float().contiguous(), segments, torch.empty(rows, n))
    if y is None and rows <= KERNEL_MAX_ROWS:
        y = _by_segment(block_kernels().vq_matmul, x2.float().contiguous(), segments, torch.empty(rows, n))
    elif y is None:
        x2 = x2.to(torch.bfloat16 if x2.dtype == torch.bfloat16 else torch.float32).contiguous()
        if _transposed(x2) and _tiled_kernel_built():  # decoded in cache (~500 vs ~440 GFLOP/s at 64 rows)
            y = _by_segment(block_kernels().vq_matmul_tiled, x2, segments, result_buffer(rows, n, torch.float32))
        if y is None:
            y = _slab_matmul(x2, segments, n)
    if bias is not None:
        y = y + bias.to(y.dtype)
    y = y if y.dtype == x.dtype else y.to(x.dtype)
    return y if flat else y.view(*x.shape[:-1], n)


def _permuted_linear(x: torch.Tensor, segments: Sequence[PackedTensor], bias: torch.Tensor | None) -> torch.Tensor:
    """Segments whose blocks hold the columns in `input_perm` order: each multiplies x's columns in its order."""
    parts = []
    for segment in segments:
        permuted = x if segment.input_perm is None else x.index_select(-1, segment.input_perm)
        parts.append(packed_linear(permuted, PackedTensor(segment.data, segment.ggml_type, segment.shape)))
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return y if bias is None else y + bias.to(y.dtype)


def _slab_matmul(x: torch.Tensor, segments: Sequence[PackedTensor], n: int) -> torch.Tensor:
    """x @ W^T with W decoded into scratch: whole when it fits (one matmul), else slab by slab, each product
    written into its columns of one contiguous y (a transposed y would make the next layer's ops copy it)."""
    k = x.shape[1]
    if n * k <= _SLAB_FLOATS:
        weight = _scratch_buffer(n * k, x.dtype).view(n, k)
        row = 0
        for segment in segments:
            _decode_rows(segment, 0, segment.shape[0], weight[row:])
            row += segment.shape[0]
        if not _transposed(x):
            return dense_linear(x, weight)  # returned as is: no column copies
        y = result_buffer(x.shape[0], n, x.dtype)
        _put_columns(y, 0, dense_linear(weight, x))
        return y
    slab_rows = 1 << (max(1, _SLAB_FLOATS // k).bit_length() - 1)
    scratch = _scratch_buffer(slab_rows * k, x.dtype)
    y = result_buffer(x.shape[0], n, x.dtype)
    offset = 0
    for segment in segments:
        for first in range(0, segment.shape[0], slab_rows):
            count = min(slab_rows, segment.shape[0] - first)
            slab = scratch[:count * k].view(count, k)  # the last slab may be short
            _decode_rows(segment, first, count, slab)
            if _transposed(x):
                _put_columns(y, offset + first, dense_linear(slab, x))
            else:
                y[:, offset + first:offset + first + count] = dense_linear(x, slab)
        offset += segment.shape[0]
    return y


def _transposed(x: torch.Tensor) -> bool:
    """Whether to multiply as W x^T: oneDNN then reads the decoded weight in place where x W^T first packs
    it, which costs more than the product's transposition while x has few rows (64 x 640 x 4096: 441 vs
    345 GFLOP/s; even from 256 rows, 449 vs 445)."""
    return x.dtype == torch.float32 and x.shape[0] <= _TRANSPOSED_MAX_ROWS


def _by_segment(kernel: Callable[..., int | None], x: torch.Tensor, segments: Sequence[PackedTensor],
                y: torch.Tensor) -> torch.Tensor | None:
    """y = x @ W^T by a C kernel called per segment, each writing its columns of the float32 y; None when the
    kernel declines one (returns 0: the tiled or small-batch kernel out of memory, or the small-batch kernel
    for a block type without its integer panels; vq_matmul returns nothing, never declines)."""
    threads, rows, n, column = torch.get_num_threads(), x.shape[0], y.shape[1], 0
    x_ptr, y_ptr = x.data_ptr(), y.data_ptr()
    for segment in segments:
        args = segment.kernel_args
        if kernel(*args, x_ptr, rows, y_ptr + 4 * column, n, threads) == 0:
            return None
        column += args[3]
    return y


@functools.cache
def _tiled_kernel_built() -> bool:
    """Whether the block library has the tiled kernel for 11-128 rows (AVX-512 builds); the others use slabs."""
    return bool(block_kernels().vq_matmul_tiled_built())


def _put_columns(y: torch.Tensor, column: int, product_t: torch.Tensor) -> None:
    """y[:, column:column + n] = product_t^T for a contiguous [n, rows] product_t."""
    n, rows = product_t.shape
    block_kernels().vq_transpose(product_t.data_ptr(), n, rows, y.data_ptr() + y.element_size() * column,
                                 y.shape[1], torch.get_num_threads())


def _scratch_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """`numel` values of this thread's decode scratch, which grows to the largest request (every layer reuses it)."""
    key = f"buffer_{dtype}"
    scratch = getattr(_scratch, key, None)
    if scratch is None or scratch.numel() < numel:
        scratch = torch.empty(numel, dtype=dtype)
        setattr(_scratch, key, scratch)
    return scratch[:numel]


def _decode_rows(segment: PackedTensor, first: int, count: int, out: torch.Tensor) -> None:
    """Rows [first, first + count) of `segment` as floats into the start of contiguous `out` (its dtype)."""
    lib = block_kernels()
    decode = lib.vq_decode_range_bf16 if out.dtype == torch.bfloat16 else lib.vq_decode_range
    decode(segment.ggml_type, segment.data.data_ptr(), segment.data.shape[1], segment.shape[1], first, count,
           out.data_ptr(), torch.get_num_threads())
