"""A quantized checkpoint's bf16 / f16 token embedding and LM head, kept in their stored dtype and mapped from
the file: the lookup decodes only the gathered rows and the head multiplies through the BF16 / F16 block
kernels, as GGUF's F16 / BF16 tensors do. Upcast at load, a 32k x 896 bf16 table would add its size again in
float32 (a 0.5B model's largest dense tensor); mapped, its pages are the file's (shared, reclaimable)."""
from __future__ import annotations

import numpy as np

from vllmpy.layers.quantized import PackedTensor
from vllmpy.loader.safetensors import TensorInfo

# Safetensors dtype -> the block kernels' type (GGML F16 = 1, BF16 = 30).
_BLOCK_TYPES = {"F16": 1, "BF16": 30}
_TABLES = ("embed_tokens.weight", "lm_head.weight")


def mapped_table(name: str, info: TensorInfo) -> PackedTensor | None:
    """The embedding or LM head `name` as a PackedTensor over the file's bytes; None for any other tensor,
    another dtype, or rows the kernels cannot take as whole runs of 32 values."""
    block_type = _BLOCK_TYPES.get(info.dtype)
    if block_type is None or not name.endswith(_TABLES) or not PackedTensor.packable(block_type, info.shape):
        return None
    rows = np.memmap(info.path, dtype=np.uint8, mode="r", offset=info.start, shape=(info.end - info.start,))
    return PackedTensor.from_numpy(rows, block_type, (info.shape[0], info.shape[1]))
