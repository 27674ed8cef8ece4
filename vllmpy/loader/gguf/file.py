"""The GGUF container read with numpy: header, metadata and memory-mapped tensor views.

gguf's GGUFReader builds one numpy view per array element, which costs ~8 s for a 262k-entry
vocabulary (three such arrays); reading the same layout here takes a fraction of a second. The
layout's constants (value types, tensor types, block sizes) and dequantization stay the gguf
package's.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

_SCALARS: dict[GGUFValueType, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"), GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"), GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"), GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"), GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"), GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
# Tensor types stored as plain numbers; every other type is kept as raw block bytes.
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: GGUF-order dims (innermost first) and a read-only view of its bytes in the mapping."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray  # numbers in numpy (outermost-first) shape, or uint8 rows of blocks


_LENGTH = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf
        self.raw = memoryview(buf)
        self.pos = 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.raw, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        text = bytes(self.raw[self.pos:self.pos + length]).decode("utf-8")
        self.pos += length
        return text

    def strings(self, count: int) -> list[str]:
        """An array of strings (a 262k-token vocabulary): one tight loop, ~3x faster than string() each."""
        raw, pos, length_at, out = self.raw, self.pos, _LENGTH.unpack_from, []
        append = out.append
        for _ in range(count):
            (length,) = length_at(raw, pos)
            pos += 8
            end = pos + length
            if end > len(raw):
                raise struct.error("a string runs past the end of the file")
            append(str(raw[pos:end], "utf-8"))
            pos = end
        self.pos = pos
        return out

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type, count = GGUFValueType(self.unpack("<I")[0]), self.unpack("<Q")[0]
            if item_type in _SCALARS:
                dtype = _SCALARS[item_type]
                items = np.frombuffer(self.buf, dtype, count, self.pos)
                self.pos += count * dtype.itemsize
                return [bool(v) for v in items] if item_type == GGUFValueType.BOOL else items.tolist()
            if item_type == GGUFValueType.STRING:
                return self.strings(count)
            return [self.value(item_type) for _ in range(count)]
        dtype = _SCALARS[vtype]
        (item,) = np.frombuffer(self.buf, dtype, 1, self.pos)
        self.pos += dtype.itemsize
        return bool(item) if vtype == GGUFValueType.BOOL else item.item()


def read_gguf(path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """(metadata, tensors) of a GGUF v2/v3 file; raises ValueError on anything malformed or truncated."""
    buf = np.memmap(path, mode="r")
    cursor = _Cursor(buf)
    try:
        magic, version = cursor.unpack("<II")
        if magic != GGUF_MAGIC:
            raise ValueError(f"bad magic {magic:#x}")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        tensor_count, kv_count = cursor.unpack("<QQ")
        metadata = {}
        for _ in range(kv_count):
            key = cursor.string()
            metadata[key] = cursor.value(GGUFValueType(cursor.unpack("<I")[0]))
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            (n_dims,) = cursor.unpack("<I")
            dims = np.array(cursor.unpack(f"<{n_dims}Q"), dtype=np.uint64)
            ggml_type, offset = cursor.unpack("<IQ")
            infos.append((name, dims, GGMLQuantizationType(ggml_type), offset))
    except struct.error as exc:
        raise ValueError(f"header is truncated ({exc})") from None
    alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    start = -(-cursor.pos // alignment) * alignment
    return metadata, [_tensor(buf, start, *info) for info in infos]


def _tensor(buf: np.ndarray, start: int, name: str, dims: np.ndarray, ggml_type: GGMLQuantizationType,
            offset: int) -> GGUFTensor:
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    n_elements = int(np.prod(dims))
    n_bytes = n_elements * type_size // block
    begin = start + offset
    if begin + n_bytes > buf.size:
        raise ValueError(f"tensor {name!r} ends at byte {begin + n_bytes} but the file has {buf.size}")
    shape = tuple(int(d) for d in reversed(dims.tolist()))
    if ggml_type in _PLAIN:
        data = np.frombuffer(buf, _PLAIN[ggml_type], n_elements, begin).reshape(shape)
    else:  # rows of blocks, as gguf.quants.dequantize takes them
        data = np.frombuffer(buf, np.uint8, n_bytes, begin).reshape(*shape[:-1], shape[-1] // block * type_size)
    return GGUFTensor(name, ggml_type, dims, data)
