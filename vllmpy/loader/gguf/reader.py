"""One .gguf file as an HF config, its metadata, and a stream of HF-named dequantized tensors.

Everything that could stop a load (architecture, tensor types, names, metadata, shapes the
transforms rely on) is checked when the checkpoint is opened, so `weights()` never fails half-way.
Tensors stay memory-mapped and are dequantized one at a time.
"""
from __future__ import annotations

import copy
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.loader.gguf.archs import ArchSpec
from vllmpy.loader.gguf.config import build_config
from vllmpy.loader.gguf.file import GGUFMetadata, GGUFTensor, read_gguf, release_pages
from vllmpy.loader.gguf.metadata import ArchMetadata
from vllmpy.loader.gguf.names import TensorName, hf_name
from vllmpy.layers.moe import expert_name, is_expert_stack
from vllmpy.layers.quantized import PackedTensor
from vllmpy.loader.gguf.quant import check_type, hf_shape, to_packed, to_packed_stack, to_torch
from vllmpy.loader.gguf.registry import arch_spec
from vllmpy.loader.gguf.transforms import Transform

_BLOCK_INDEX = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class _Planned:
    tensor: GGUFTensor
    name: str  # HF name
    transform: Transform | None
    parts: tuple[str, ...]  # the HF names it yields: (name,), or the equal row blocks of a split tensor
    head_stack: bool = False  # a 3-D per-head weight kept packed as one matrix (ArchSpec.head_stacks)


class GGUFCheckpoint:
    """A .gguf file, checked whole when opened; refusals are `UnsupportedCheckpointError`s naming the path."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            self._metadata, self._config, self._plan = _read(self.path)
        except UnsupportedCheckpointError as exc:
            raise UnsupportedCheckpointError(f"{self.path}: {exc}") from None

    @property
    def config(self) -> dict[str, Any]:
        """A fresh copy each call, so callers may edit it."""
        return copy.deepcopy(self._config)

    @property
    def metadata(self) -> GGUFMetadata:
        """Every GGUF key/value (tokenizer.ggml.* included; long arrays decoded on first read); shared, read-only."""
        return self._metadata

    def release_pages(self) -> None:
        """After loading: the file's pages leave this process's RSS, and those the model still reads come back
        on use (`file.release_pages`)."""
        if self._plan:
            release_pages(self._plan[0].tensor.data)

    @property
    def num_tensors(self) -> int:
        """How many tensors `weights()` yields (a split tensor counts once per part)."""
        return sum(len(planned.parts) for planned in self._plan)

    def weights(self, dtype: torch.dtype, keep_packed: bool = False) -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
        """(HF name, tensor in HF layout) pairs, each dequantized only when reached.

        keep_packed: 2-D block-quantized (and F16/BF16) tensors come as `PackedTensor`s over the file's
        bytes instead, for the CPU kernels to compute on; an MoE expert stack as one per expert, under
        the per-expert HF names (`experts.3.gate_proj.weight`).
        """
        for planned in self._plan:
            transform = planned.transform
            stacked = is_expert_stack(planned.parts[0])  # a fused gate_up stack's parts are gate / up stacks
            stack = to_packed_stack(planned.tensor) if keep_packed and stacked else None
            if stack is not None and transform is None:
                for expert, matrix in enumerate(stack):
                    for name, part in zip(planned.parts, _row_parts(matrix, len(planned.parts))):
                        yield expert_name(name, expert), part
                continue
            packed = to_packed(planned.tensor, planned.head_stack) if keep_packed else None
            if packed is not None and transform is not None:
                packed = transform.packed(packed, self._config)
            if packed is not None:
                yield from zip(planned.parts, _row_parts(packed, len(planned.parts)))
                continue
            tensor = to_torch(planned.tensor)
            if transform is not None:
                tensor = transform(tensor, self._config)
            yield from zip(planned.parts, _row_parts(tensor.to(dtype), len(planned.parts), dim=int(stacked)))


def _row_parts(tensor: torch.Tensor | PackedTensor, count: int, dim: int = 0) -> list[torch.Tensor | PackedTensor]:
    """A tensor the converter fused (`ArchSpec.splits`) cut back into `count` equal row blocks (an expert
    stack's or its bias's along dim 1, each expert's rows)."""
    if count == 1:
        return [tensor]
    if isinstance(tensor, torch.Tensor):
        return list(tensor.chunk(count, dim))
    rows = tensor.shape[0] // count
    return [PackedTensor(data, tensor.ggml_type, (rows, tensor.shape[1]), tensor.input_perm)
            for data in tensor.data.chunk(count)]


def _open(path: str) -> tuple[GGUFMetadata, list[GGUFTensor]]:
    """Metadata and tensors, with low-level failures (bad magic, truncation) turned into a named refusal."""
    try:
        return read_gguf(path)
    except (ValueError, KeyError, IndexError, OverflowError, TypeError, UnicodeDecodeError) as exc:
        raise UnsupportedCheckpointError(f"not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def _read(path: str) -> tuple[GGUFMetadata, dict[str, Any], list[_Planned]]:
    """Metadata, config and the plan for every tensor, refusing on the first problem.

    The planned tensors are views of the file mapping, which they keep open.
    """
    metadata, tensors = _open(path)
    arch = metadata.get("general.architecture")
    spec = arch_spec(arch)
    for tensor in tensors:
        check_type(tensor)
    by_name = {tensor.name: tensor for tensor in tensors}
    if len(by_name) != len(tensors):
        raise UnsupportedCheckpointError("the file lists a tensor name twice")
    values = {name: to_torch(by_name[name]).numpy() for name in spec.config_tensors if name in by_name}
    config = build_config(spec, ArchMetadata(metadata, arch), {name: hf_shape(t) for name, t in by_name.items()},
                          values.get("rope_freqs.weight"), values)
    return metadata, config, _plan(arch, spec, tensors, config)


def _plan(arch: str, spec: ArchSpec, tensors: list[GGUFTensor], config: dict) -> list[_Planned]:
    plan = []
    for tensor in tensors:
        if tensor.name in spec.config_tensors or (not spec.mtp_names and _is_mtp_block(tensor.name, config)):
            continue
        name = hf_name(spec, tensor.name, config["num_hidden_layers"], config.get("num_nextn_predict_layers") or 0)
        if name is None:
            raise UnsupportedCheckpointError(
                f"tensor {tensor.name!r} has no mapping for GGUF architecture {arch!r} "
                f"({spec.hf_architecture}); this file is not supported")
        transform = spec.transforms.get(name.key)
        if transform is not None:
            transform.check(tensor.name, hf_shape(tensor), config)
        parts = _split_names(spec, name, tensor)
        plan.append(_Planned(tensor, name.hf, transform, parts, name.key in spec.head_stacks))
    return plan


def _split_names(spec: ArchSpec, name: TensorName, tensor: GGUFTensor) -> tuple[str, ...]:
    """The HF names of a tensor's row blocks: its own name, or those `spec.splits` lists for its leaf."""
    leaves = spec.splits.get(name.key)
    if leaves is None:
        return (name.hf,)
    layer = name.hf.split(".")[2]
    parts = tuple(f"model.layers.{layer}.{leaf}" for leaf in leaves)
    rows = hf_shape(tensor)[int(is_expert_stack(parts[0]))]
    if rows % len(leaves):
        raise UnsupportedCheckpointError(
            f"tensor {tensor.name!r} has {rows} rows, which do not split into {len(leaves)} equal parts")
    return parts


def _is_mtp_block(name: str, config: dict) -> bool:
    """A block llama.cpp's converter appends after the decoder for multi-token prediction (qwen35's
    nextn layers): skipped where the architecture names no MTP tensors (ArchSpec.mtp_names)."""
    match = _BLOCK_INDEX.match(name)
    return bool(config.get("num_nextn_predict_layers") and match and int(match[1]) >= config["num_hidden_layers"])
