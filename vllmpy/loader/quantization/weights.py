"""The weight stream of a quantized safetensors checkpoint: each quantized module's tensors read together
(from whichever shard holds each) into one packed `<module>.weight`, a bf16 / f16 embedding or LM head
mapped from the file in its stored dtype (tables.py), every other tensor dense as usual.

Opening plans every module from the config and the shard headers, so refusals (unsupported fields, a config
naming a module the checkpoint lacks, a tensor of an unexpected dtype) come before any weight is read.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import BinaryIO

import torch
from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.quantized import PackedTensor
from vllmpy.loader.heap import return_freed_heap
from vllmpy.loader.quantization.config import QuantConfig, Scheme
from vllmpy.loader.quantization.formats import COMPONENTS, read_parts
from vllmpy.loader.quantization.tables import mapped_table
from vllmpy.loader.safetensors import TensorInfo, check_dtype, shard_files, tensor_index

# Integer tensors of the layouts (codes, zero points, g_idx, shapes) and the fp8 codes.
_QUANT_DTYPES = {"I32", "I64", "I8", "U8", "F8_E4M3"}
_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
                 "I64": torch.int64, "I8": torch.int8, "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn}


def read_tensor(f: BinaryIO, info: TensorInfo) -> torch.Tensor:
    """One tensor read into memory it owns. A plain read, not the file's memory mapping: mapped pages would
    count in the process's RSS beside the repacked blocks until the whole load ends."""
    buffer = bytearray(info.end - info.start)
    f.seek(info.start)
    if f.readinto(buffer) != len(buffer):
        raise UnsupportedCheckpointError(f"{info.path}: truncated while reading a tensor")
    if not buffer:
        return torch.empty(info.shape, dtype=_TORCH_DTYPES[info.dtype])
    return torch.frombuffer(buffer, dtype=_TORCH_DTYPES[info.dtype]).reshape(info.shape)


class QuantizedSafetensors:
    """`iterate(dtype)` yields (name, tensor | PackedTensor); `dense(dtype)` the same with every packed
    weight decoded to `dtype` (devices the block kernels do not run on)."""

    def __init__(self, model_dir: str, quant: QuantConfig) -> None:
        self.files = shard_files(model_dir)
        self.index = tensor_index(self.files)
        self.plan: dict[str, Scheme] = quant.plan(self.index)
        self.owner: dict[str, str] = {}  # component tensor -> its quantized module
        for module, scheme in self.plan.items():
            for component in COMPONENTS[scheme.layout]:
                name = f"{module}.{component}"
                if name in self.index:
                    self.owner[name] = module
        for name, (path, dtype, *_) in self.index.items():
            if name in self.owner:
                if dtype not in _QUANT_DTYPES | {"F32", "F16", "BF16"}:
                    raise UnsupportedCheckpointError(
                        f"tensor {name!r} in {path} has dtype {dtype}; supported here: "
                        f"{', '.join(sorted(_QUANT_DTYPES))}, F32, F16, BF16")
            elif name.endswith((".qweight", ".weight_packed")) or dtype in _QUANT_DTYPES:
                raise UnsupportedCheckpointError(
                    f"tensor {name!r} is stored quantized ({dtype}) but quantization_config leaves its module "
                    f"unquantized")
            else:
                check_dtype(name, path, dtype)
        self.num_tensors = len(self.index) - len(self.owner) + len(self.plan)

    def iterate(self, dtype: torch.dtype, tables: bool = True) -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
        """tables: a bf16 / f16 embedding or LM head comes packed over the file (tables.py), else in `dtype`."""
        with contextlib.ExitStack() as stack:
            files = {path: stack.enter_context(open(path, "rb")) for path in self.files}

            def get(name: str) -> torch.Tensor:
                info = self.index[name]
                return read_tensor(files[info.path], info)

            done: set[str] = set()
            for name in sorted(self.index, key=lambda n: (self.index[n].path, self.index[n].start)):
                module = self.owner.get(name)
                if module is None:
                    table = mapped_table(name, self.index[name]) if tables else None
                    yield name, table if table is not None else get(name).to(dtype)
                elif module not in done:
                    done.add(module)
                    parts = read_parts(module, self.plan[module], get, self.index.__contains__)
                    return_freed_heap()
                    yield from parts

    def dense(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.iterate(dtype, tables=False):
            yield name, tensor.dequantize().to(dtype) if isinstance(tensor, PackedTensor) else tensor
