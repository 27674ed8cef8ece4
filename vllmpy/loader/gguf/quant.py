"""Which GGML tensor types we load, and dequantizing one with the gguf package's reference code."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.quantized import PackedTensor
from vllmpy.loader.gguf.file import GGUFTensor

SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                   Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4)


def check_type(tensor: GGUFTensor) -> None:
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise UnsupportedCheckpointError(
            f"tensor {tensor.name!r} has GGML type {tensor.tensor_type.name}, which is not supported; "
            f"supported types: {', '.join(t.name for t in SUPPORTED_TYPES)}")


def hf_shape(tensor: GGUFTensor) -> tuple[int, ...]:
    """GGUF lists dims innermost first; HF (and numpy) outermost first: [out, in] for a linear weight."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def to_packed(tensor: GGUFTensor, head_stack: bool = False) -> PackedTensor | None:
    """The tensor's blocks, uncopied, where the CPU kernels compute on them; else None. A `head_stack`
    [heads, out, in] (deepseek2's attn_k_b / attn_v_b) comes as one [heads * out, in] matrix of its rows."""
    shape = hf_shape(tensor)
    if head_stack and len(shape) == 3:
        shape = (shape[0] * shape[1], shape[2])
    if tensor.tensor_type == Q.F32 or not PackedTensor.packable(int(tensor.tensor_type), shape):
        return None
    return PackedTensor.from_numpy(tensor.data, int(tensor.tensor_type), shape)


def to_packed_stack(tensor: GGUFTensor) -> list[PackedTensor] | None:
    """A 3-D [E, out, in] tensor (an MoE expert stack) as E packed matrices, each a view of the file's
    blocks; None where one matrix would not be packed (F32, a row length the kernels do not take)."""
    shape = hf_shape(tensor)
    if len(shape) != 3 or tensor.tensor_type == Q.F32 or not PackedTensor.packable(int(tensor.tensor_type), shape[1:]):
        return None
    return [PackedTensor.from_numpy(tensor.data[e], int(tensor.tensor_type), shape[1:]) for e in range(shape[0])]


def to_torch(tensor: GGUFTensor) -> torch.Tensor:
    """Dequantize to a float32 tensor in HF shape that owns its memory: the read-only file mapping is copied."""
    values = dequantize(tensor.data, tensor.tensor_type)
    values = np.require(values, dtype=np.float32, requirements=("C", "W"))
    return torch.from_numpy(values.reshape(hf_shape(tensor)))
