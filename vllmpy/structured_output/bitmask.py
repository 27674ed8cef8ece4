"""Token bitmasks: one int32 word per 32 vocabulary ids, applied to the constrained rows of a batch."""
from __future__ import annotations

import torch

# Byte value -> its 8 bits as additive logit masks (0 = allowed, -inf = banned), least significant bit
# first. Gathering whole bytes is ~4x faster on CPU than shifting out single bits, and an add is
# cheaper than masked_fill; the mask's int32 words are little-endian, so byte i covers ids 8i..8i+7.
_BYTE_TO_ADDEND = torch.where(
    (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1 == 1, 0.0, float("-inf"))


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """All-zero (everything banned) masks; each grammar fills its own row."""
    return torch.zeros(num_rows, (vocab_size + 31) // 32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the banned ids of `rows` (None = every row) to -inf, in place; returns logits."""
    num_rows, vocab_size = bitmask.shape[0], logits.shape[1]
    table = _BYTE_TO_ADDEND.to(logits.device)
    addend = table[bitmask.to(logits.device).view(torch.uint8).long()].view(num_rows, -1)[:, :vocab_size]
    if rows is None:
        return logits.add_(addend)
    return logits.index_add_(0, rows, addend)
