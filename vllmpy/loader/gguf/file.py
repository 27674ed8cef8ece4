"""The GGUF container read with numpy: header, metadata and memory-mapped tensor views.

gguf's GGUFReader builds one numpy view per array element, which costs ~8 s for a 262k-entry
vocabulary (three such arrays); reading the same layout here takes a fraction of a second, and long
arrays are only decoded when a caller reads them (`GGUFMetadata`). The layout's constants (value types,
tensor types, block sizes) and dequantization stay the gguf package's.
"""
from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Mapping
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
    def __init__(self, buf: np.ndarray, pos: int = 0) -> None:
        self.buf = buf
        self.raw = memoryview(buf)
        self.pos = pos

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

    def skip_strings(self, count: int) -> None:
        """Step over an array of strings without decoding it (lengths only)."""
        raw, pos, length_at = self.raw, self.pos, _LENGTH.unpack_from
        for _ in range(count):
            pos += 8 + length_at(raw, pos)[0]
        if pos > len(raw):
            raise struct.error("a string runs past the end of the file")
        self.pos = pos

    def items(self, item_type: GGUFValueType, count: int) -> list:
        """`count` array items of `item_type` as python values."""
        if item_type in _SCALARS:
            dtype = _SCALARS[item_type]
            items = np.frombuffer(self.buf, dtype, count, self.pos)
            self.pos += count * dtype.itemsize
            return [bool(v) for v in items] if item_type == GGUFValueType.BOOL else items.tolist()
        if item_type == GGUFValueType.STRING:
            return self.strings(count)
        return [self.value(item_type) for _ in range(count)]

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type, count = GGUFValueType(self.unpack("<I")[0]), self.unpack("<Q")[0]
            return self.items(item_type, count)
        dtype = _SCALARS[vtype]
        (item,) = np.frombuffer(self.buf, dtype, 1, self.pos)
        self.pos += dtype.itemsize
        return bool(item) if vtype == GGUFValueType.BOOL else item.item()

    def entry(self) -> tuple[Any, tuple[GGUFValueType, int, int] | None]:
        """The next value, or (None, (item type, count, offset)) for an array left undecoded: one of more than
        _EAGER_ITEMS strings or numbers."""
        vtype = GGUFValueType(self.unpack("<I")[0])
        if vtype != GGUFValueType.ARRAY:
            return self.value(vtype), None
        item_type, count = GGUFValueType(self.unpack("<I")[0]), self.unpack("<Q")[0]
        if count <= _EAGER_ITEMS or not (item_type in _SCALARS or item_type == GGUFValueType.STRING):
            return self.items(item_type, count), None
        deferred = (item_type, count, self.pos)
        if item_type == GGUFValueType.STRING:
            self.skip_strings(count)
        else:
            self.pos += count * _SCALARS[item_type].itemsize
            if self.pos > len(self.raw):
                raise struct.error("an array runs past the end of the file")
        return None, deferred


# Longer arrays (a vocabulary, its scores, types and merges) are decoded when first read.
_EAGER_ITEMS = 1024


class GGUFMetadata(Mapping[str, Any]):
    """A file's key/values, in file order; arrays longer than _EAGER_ITEMS are decoded on first read.

    A start whose tokenizer comes from its cache (vllmpy/tokenizer/gguf_cache.py) never reads the
    vocabulary, so it never builds its lists: ~0.1 s and ~40 MB for Gemma 3's 262k tokens and scores.
    `encoded(key)` is a value's bytes as the file stores them, to fingerprint it without decoding.
    """

    def __init__(self, buf: np.ndarray) -> None:
        self._buf = buf
        self._values: dict[str, Any] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # key -> [start, end) of its value, type tag included
        self._deferred: dict[str, tuple[GGUFValueType, int, int]] = {}

    def _add(self, key: str, value: Any, span: tuple[int, int], deferred: tuple[GGUFValueType, int, int] | None) -> None:
        self._spans[key] = span
        if deferred is None:
            self._values[key] = value
        else:
            self._deferred[key] = deferred

    def __getitem__(self, key: str) -> Any:
        if key in self._deferred:
            item_type, count, pos = self._deferred[key]
            self._values[key] = _Cursor(self._buf, pos).items(item_type, count)
            del self._deferred[key]
        return self._values[key]

    def __contains__(self, key: object) -> bool:  # Mapping's default would decode the value
        return key in self._spans

    def __iter__(self) -> Iterator[str]:
        return iter(self._spans)

    def __len__(self) -> int:
        return len(self._spans)

    def encoded(self, key: str) -> bytes:
        """The value's type tag and payload as stored in the file."""
        start, end = self._spans[key]
        return self._buf[start:end].tobytes()


def read_gguf(path: str) -> tuple[GGUFMetadata, list[GGUFTensor]]:
    """(metadata, tensors) of a GGUF v2/v3 file; raises ValueError on anything malformed or truncated
    (a long array's strings are checked as UTF-8 when first read)."""
    with open(path, "rb") as file:
        buf = np.frombuffer(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
    cursor = _Cursor(buf)
    try:
        magic, version = cursor.unpack("<II")
        if magic != GGUF_MAGIC:
            raise ValueError(f"bad magic {magic:#x}")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        tensor_count, kv_count = cursor.unpack("<QQ")
        metadata = GGUFMetadata(buf)
        for _ in range(kv_count):
            key = cursor.string()
            start = cursor.pos
            value, deferred = cursor.entry()
            metadata._add(key, value, (start, cursor.pos), deferred)
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


def release_pages(view: np.ndarray) -> None:
    """Take the resident pages of the file mapping under `view` (an array read_gguf returned) out of this
    process's RSS. The page cache keeps them, and an array still in use faults its pages back in when next
    read: after loading, that drops the pages of tensors the model copied (fused q/k/v and gate/up: 42 MB
    on the default model) and keeps those it computes on."""
    base: object = view
    while isinstance(base, np.ndarray):
        base = base.base
    mapping = base.obj if isinstance(base, memoryview) else None
    if isinstance(mapping, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)
