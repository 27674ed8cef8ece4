"""How one layer's paged K/V are stored: the element dtype decides the format.

- float32 / bfloat16 / float16: the values themselves.
- float8_e4m3fn / float8_e5m2 (`--kv-cache-dtype fp8*`): 1 byte per value over one per-tensor scale per
  layer for K and one for V (the checkpoint's k_scale / v_scale, else 1.0): stored = value / scale.
- int8 (`--kv-cache-dtype int8`, llama.cpp's q8_0 idea): 1 byte per value and an fp16 scale per group of
  `int8_group(head_dim)` (32) consecutive values of one head's row, computed as the row is written
  (amax / 127), no calibration. The scales live in their own plane after the values in the layer's
  buffer, so value rows stay dense (the C kernel loads them as vectors, torch views them as one
  tensor); fp16 rather than fp32 because its 2^-11 rounding is far below int8's 2^-8 step and it keeps
  the overhead at 1/16 of the values (2 bytes per 32).

Every path attends what the cache holds: `write` returns this step's K/V as stored (quantized and read
back), so a prompt computed in one prefill, in chunks or over a prefix-cache hit sees the same keys.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INT8_GROUP = 32
INT8_MAX = 127.0
_FP16_MAX = 65504.0


def int8_group(head_dim: int) -> int:
    """Values per int8 scale: 32, or the largest power of two dividing a head_dim that 32 does not."""
    return math.gcd(head_dim, INT8_GROUP)


def scale_plane_elems(head_dim: int) -> int:
    """fp16 scales per head row of an int8 cache."""
    return head_dim // int8_group(head_dim)


def element_bytes(dtype: torch.dtype, head_dim: int) -> float:
    """Bytes one cached value costs, its share of the int8 scales included."""
    if dtype == torch.int8:
        return 1 + 2 / int8_group(head_dim)
    return dtype.itemsize


@dataclass
class PagedKVCache:
    """One layer's cache: data [2, num_blocks, block_size, kv_heads, head_dim] (K then V) in the
    storage dtype; an int8 cache's scales [2, num_blocks, block_size, kv_heads, head_dim // group] fp16;
    an fp8 cache's per-tensor k_scale / v_scale."""

    data: torch.Tensor
    scales: torch.Tensor | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    # K's and V's planes [slots, kv_heads, head_dim], viewed once: a step writes and reads them in every layer.
    planes: tuple[torch.Tensor, torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        heads, dim = self.data.shape[-2:]
        self.planes = (self.data[0].view(-1, heads, dim), self.data[1].view(-1, heads, dim))

    @classmethod
    def over_buffer(cls, buffer: torch.Tensor, dtype: torch.dtype, num_blocks: int, block_size: int,
                    kv_heads: int, head_dim: int) -> PagedKVCache:
        """The layer's cache viewed over its byte buffer (values first, then an int8 cache's scales)."""
        shape = (2, num_blocks, block_size, kv_heads, head_dim)
        values = math.prod(shape) * dtype.itemsize
        data = buffer[:values].view(dtype).view(shape)
        if dtype != torch.int8:
            return cls(data)
        scale_shape = shape[:-1] + (scale_plane_elems(head_dim),)
        scales = buffer[values:values + 2 * math.prod(scale_shape)].view(torch.float16).view(scale_shape)
        return cls(data, scales)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def block_size(self) -> int:
        return self.data.shape[2]

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v [T, kv_heads, head_dim] at their slots; return them as stored."""
        return self._write_one(0, k, self.k_scale, slot_mapping), self._write_one(1, v, self.v_scale, slot_mapping)

    def _write_one(self, which: int, x: torch.Tensor, scale: float, slots: torch.Tensor) -> torch.Tensor:
        flat = self.planes[which]
        if self.data.dtype == x.dtype:  # the model's dtype, checked first: 36 writes a step at decode
            flat.index_copy_(0, slots, x)
            return x
        if self.dtype == torch.int8:
            codes, scales = quantize_int8(x)
            flat.index_copy_(0, slots, codes)
            self.scales[which].view(-1, flat.shape[1], scales.shape[-1]).index_copy_(0, slots, scales)
            return dequantize_int8(codes, scales, x.dtype)
        if self.dtype in FP8_DTYPES:
            codes = quantize_fp8(x, scale, self.dtype)
            flat.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))
            return codes.to(x.dtype) * scale
        stored = x.to(self.dtype)
        flat.index_copy_(0, slots, stored)
        return stored.to(x.dtype)

    def gather(self, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the listed blocks, [*blocks.shape, block_size, kv_heads, head_dim] in `dtype`:
        only these blocks are read and converted."""
        keys, values = self.data[0, blocks], self.data[1, blocks]
        if self.dtype == torch.int8:
            return (dequantize_int8(keys, self.scales[0, blocks], dtype),
                    dequantize_int8(values, self.scales[1, blocks], dtype))
        if self.dtype in FP8_DTYPES:
            return keys.to(dtype) * self.k_scale, values.to(dtype) * self.v_scale
        return keys.to(dtype), values.to(dtype)


def as_paged(kv_cache: PagedKVCache | torch.Tensor) -> PagedKVCache:
    """A bare [2, blocks, block_size, heads, dim] tensor is an unscaled cache."""
    return kv_cache if isinstance(kv_cache, PagedKVCache) else PagedKVCache(kv_cache)


def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in fp8, saturated at the format's largest finite value (no inf, no NaN in the cache)."""
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-top, top).to(dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., dim] -> (int8 codes [..., dim], fp16 scales [..., dim // group]): each group of values is
    rounded against its own amax / 127, the scale rounded to fp16 first so codes and scale agree."""
    *lead, dim = x.shape
    groups = x.float().reshape(*lead, scale_plane_elems(dim), int8_group(dim))
    scales = (groups.abs().amax(-1) / INT8_MAX).clamp(max=_FP16_MAX).to(torch.float16)
    divisor = scales.float().masked_fill(scales == 0, 1.0)[..., None]
    codes = (groups / divisor).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes.reshape(*lead, dim), scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    *lead, dim = codes.shape
    groups = codes.to(dtype).reshape(*lead, scales.shape[-1], dim // scales.shape[-1])
    return (groups * scales.to(dtype)[..., None]).reshape(*lead, dim)
