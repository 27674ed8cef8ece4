"""Hugging Face safetensors checkpoints: single file or sharded (index.json), memory-mapped.

Every shard's header is opened and checked before the first weight is read, so a missing shard,
a truncated file or an unsupported dtype is refused before anything is loaded.
"""
from __future__ import annotations

import json
import os
from typing import Iterator, NamedTuple

import torch
from safetensors import safe_open

from vllmpy.errors import UnsupportedCheckpointError

SUPPORTED_DTYPES = {"F32", "F16", "BF16"}
# Integer buffers some checkpoints save (BERT's `embeddings.position_ids` = arange): derived, never
# weights, so they are skipped rather than refused for their dtype.
DERIVED_BUFFERS = (".position_ids",)
INDEX_FILE = "model.safetensors.index.json"


def shard_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.exists(os.path.join(model_dir, name)):
                raise UnsupportedCheckpointError(
                    f"shard {name!r} listed in {INDEX_FILE} is missing from {model_dir}")
        return [os.path.join(model_dir, name) for name in files]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise UnsupportedCheckpointError(f"no *.safetensors weights (or {INDEX_FILE}) in {model_dir}")
    return [os.path.join(model_dir, f) for f in files]


def _header(path: str) -> dict:
    """Parse the JSON header and check that the file holds every byte it declares."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError("header length exceeds the file")
            header = json.loads(f.read(n))
    except (ValueError, OSError) as exc:
        raise UnsupportedCheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
    end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise UnsupportedCheckpointError(
            f"{path}: truncated: the header declares {8 + n + end} bytes but the file has {size}")
    return header


class TensorInfo(NamedTuple):
    path: str  # the shard holding it
    dtype: str  # safetensors dtype name: F32, I32, F8_E4M3, ...
    shape: tuple[int, ...]
    start: int  # byte offset of its data in the file
    end: int


def tensor_index(files: list[str]) -> dict[str, TensorInfo]:
    """Every weight in the shards, from their headers alone."""
    index = {}
    for path in files:
        with open(path, "rb") as f:
            data_start = 8 + int.from_bytes(f.read(8), "little")
        for name, info in _header(path).items():
            if name != "__metadata__" and not name.endswith(DERIVED_BUFFERS):
                begin, end = info["data_offsets"]
                index[name] = TensorInfo(path, info["dtype"], tuple(info["shape"]), data_start + begin,
                                         data_start + end)
    return index


def check_dtype(name: str, path: str, dtype: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedCheckpointError(
            f"tensor {name!r} in {os.path.basename(path)} has dtype {dtype}; "
            f"supported dtypes: {', '.join(sorted(SUPPORTED_DTYPES))}")


class SafetensorsWeights:
    """Validates all shards up front; `iterate(dtype)` then streams (name, tensor) one at a time."""

    def __init__(self, model_dir: str) -> None:
        self.files = shard_files(model_dir)
        index = tensor_index(self.files)
        self.num_tensors = len(index)
        for name, info in index.items():
            check_dtype(name, info.path, info.dtype)

    def iterate(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        for path in self.files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if not name.endswith(DERIVED_BUFFERS):
                        yield name, f.get_tensor(name).to(dtype)
