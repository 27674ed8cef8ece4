"""A MoE projection's packed experts multiplied in one C call at decode.

At decode each active expert gets one to a few rows; a Python loop pays one `packed_linear` call (and one
parallel region with its closing barrier) per active expert and projection: 12 calls per layer at top-6.
`vq_matmul_experts` runs every active expert's rows in one call, through the same integer row dots that
`packed_linear` takes for those row counts, so the results are bit-identical to the loop's.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllmpy.kernels import block_fma_rows, block_kernels
from vllmpy.layers.quantized import SMALL_MIN_ROWS, PackedTensor

# Rows per expert that packed_linear hands to vq_matmul's row dots for every block type (the small-batch kernel
# starts at SMALL_MIN_ROWS); types whose few rows go to block_fma.c instead are not grouped.
MAX_ROWS = SMALL_MIN_ROWS - 1


def takes_rows(x: torch.Tensor, counts: torch.Tensor) -> bool:
    """Whether no expert has more than MAX_ROWS of x's rows: checked before any copy or allocation, so a prefill's
    many rows per expert go straight to the per-expert loop."""
    return x.shape[0] <= MAX_ROWS or int(counts.max()) <= MAX_ROWS


@dataclass(frozen=True)
class PackedExperts:
    """Per expert: its block type, the address of its packed [n, k] rows and their stride (the tensors stay
    referenced by the caller's segments)."""

    types: torch.Tensor  # int32 [E]
    addresses: torch.Tensor  # int64 [E]
    row_bytes: torch.Tensor  # int64 [E]
    n: int
    k: int

    @classmethod
    def build(cls, experts: Sequence[Sequence[PackedTensor]]) -> PackedExperts | None:
        """The table, or None unless every expert is one unpermuted segment of one shape whose few rows take
        vq_matmul's row dots (the grouped call must equal packed_linear's path)."""
        if block_kernels() is None or not experts or any(len(segments) != 1 for segments in experts):
            return None
        weights = [segments[0] for segments in experts]
        shape = weights[0].shape
        for weight in weights:
            if weight.shape != shape or weight.input_perm is not None or any(
                    rows in block_fma_rows(weight.ggml_type) for rows in range(1, MAX_ROWS + 1)):
                return None
        return cls(torch.tensor([w.ggml_type for w in weights], dtype=torch.int32),
                   torch.tensor([w.data.data_ptr() for w in weights], dtype=torch.int64),
                   torch.tensor([w.data.shape[1] for w in weights], dtype=torch.int64), shape[0], shape[1])

    def matmul(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        """x's rows sorted by expert, counts[e] (int64) of them for expert e: row @ W_e^T, or None
        where the kernel declines (an expert with more than MAX_ROWS rows, a type without row dots). The
        result in x's dtype, as packed_linear gives it."""
        rows = x.float().contiguous()
        y = torch.empty(x.shape[0], self.n)
        done = block_kernels().vq_matmul_experts(
            self.types.data_ptr(), self.addresses.data_ptr(), self.row_bytes.data_ptr(), self.types.shape[0],
            counts.data_ptr(), MAX_ROWS, self.n, self.k, rows.data_ptr(), y.data_ptr(), self.n,
            torch.get_num_threads())
        if not done:
            return None
        return y if y.dtype == x.dtype else y.to(x.dtype)
