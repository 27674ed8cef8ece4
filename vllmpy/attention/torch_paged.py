"""Portable paged attention in plain torch (any device).

K/V are written into the paged cache through the slot mapping. Decode rows (one new token) are
attended in one batched call over the blocks each row needs (only the window's blocks for sliding
layers); prefill rows attend one sequence at a time, reading the in-flight K/V directly when the
sequence has no cached context. Non-causal (encoder) layers always get whole sequences in one step and
never decode, so they attend the in-flight K/V and leave the cache alone.
"""
from __future__ import annotations

import torch

from vllmpy.attention.base import AttentionMetadata, AttentionSpec


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim]."""
    heads, dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, heads, dim).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, heads, dim).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
    """q: [T, heads, dim], k/v: [T, kv_heads, dim] (this step's tokens) → [T, heads, dim]."""
    if not spec.causal:
        return _encoder_attention(q, k, v, meta, spec)
    write_kv(kv_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.decode_rows:
        index = _decode_index(meta, spec.sliding_window, q.device)
        out[index["token_idx"]] = _decode(q[index["token_idx"]], kv_cache, index, spec)
    for row in meta.prefill_rows:
        start, end = meta.query_start_loc[row], meta.query_start_loc[row + 1]
        seq_len = meta.seq_lens[row]
        if seq_len == end - start:  # no cached context: attend this step's K/V directly
            keys, values = k[start:end], v[start:end]
        else:
            keys, values = _gather_seq(kv_cache, meta, row, seq_len)
        out[start:end] = _prefill(q[start:end], keys, values, seq_len, spec)
    return out


def _encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                       spec: AttentionSpec) -> torch.Tensor:
    """Bidirectional attention within each sequence; the scheduler gives an encoder whole prompts only."""
    out = torch.empty_like(q)
    for row in range(meta.num_seqs):
        start, end = meta.query_start_loc[row], meta.query_start_loc[row + 1]
        if meta.seq_lens[row] != end - start:
            raise RuntimeError("an encoder sequence was split across steps; chunked prefill and prefix "
                               "caching must be off for non-causal models")
        out[start:end] = _prefill(q[start:end], k[start:end], v[start:end], end - start, spec)
    return out


def _gather_seq(kv_cache: torch.Tensor, meta: AttentionMetadata, row: int,
                seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks = -(-seq_len // meta.block_size)
    blocks = meta.block_tables[row, :num_blocks]
    heads, dim = kv_cache.shape[-2:]
    keys = kv_cache[0, blocks].reshape(-1, heads, dim)[:seq_len]
    values = kv_cache[1, blocks].reshape(-1, heads, dim)[:seq_len]
    return keys, values


def _grouped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a: [..., kv_heads, group, M, K] @ b: [..., kv_heads, K, N] → [..., kv_heads, group, M, N].

    The query heads sharing a KV head are folded into the rows, so K/V are never broadcast (a
    broadcast matmul would materialize a copy of them per query head).
    """
    *lead, group, rows, inner = a.shape
    out = torch.matmul(a.reshape(*lead, group * rows, inner), b)
    return out.view(*lead, group, rows, out.shape[-1])


def _scores(q: torch.Tensor, keys: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """q: [..., kv_heads, group, Lq, dim], keys: [..., kv_heads, Lk, dim] → scores [..., kv_heads, group, Lq, Lk]."""
    scores = _grouped_matmul(q, keys.transpose(-1, -2)) * spec.scale
    if spec.logit_soft_cap:
        scores = torch.tanh(scores / spec.logit_soft_cap) * spec.logit_soft_cap
    return scores


def _prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_len: int,
             spec: AttentionSpec) -> torch.Tensor:
    q_len = q.shape[0]
    group = spec.num_heads // spec.num_kv_heads
    if not spec.logit_soft_cap and spec.sliding_window is None and q_len == seq_len:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1).to(q.dtype), values.transpose(0, 1).to(q.dtype),
            is_causal=spec.causal, scale=spec.scale, enable_gqa=group > 1)
        return out.transpose(0, 1)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    visible = k_pos <= q_pos if spec.causal else torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device)
    if spec.sliding_window is not None:
        visible &= k_pos > q_pos - spec.sliding_window
    qh = q.view(q_len, spec.num_kv_heads, group, -1).permute(1, 2, 0, 3)  # [kvh, g, Lq, d]
    scores = _scores(qh, keys.transpose(0, 1).to(q.dtype), spec)  # [kvh, g, Lq, Lk]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = _grouped_matmul(probs, values.transpose(0, 1).to(q.dtype))  # [kvh, g, Lq, d]
    return out.permute(2, 0, 1, 3).reshape(q_len, spec.num_heads, -1)


def _decode_index(meta: AttentionMetadata, window: int | None, device: torch.device) -> dict:
    """Block indices and mask for the batched decode rows; memoised per step and window."""
    key = ("decode", window)
    if key in meta.cache:
        return meta.cache[key]
    rows = meta.decode_rows
    bs = meta.block_size
    seq_lens = [meta.seq_lens[r] for r in rows]
    # First block each row needs: all for full attention, only the window's for sliding layers.
    first = [0 if window is None else max(0, (n - window)) // bs for n in seq_lens]
    last = [-(-n // bs) for n in seq_lens]
    width = max(b - a for a, b in zip(first, last))
    offsets = torch.arange(width, device=device)
    first_t = torch.tensor(first, device=device)
    table = meta.block_tables[rows]
    cols = (first_t[:, None] + offsets[None, :]).clamp(max=table.shape[1] - 1)
    blocks = torch.gather(table, 1, cols)  # [B, width]
    k_pos = (first_t[:, None] * bs + torch.arange(width * bs, device=device)[None, :])
    n = torch.tensor(seq_lens, device=device)[:, None]
    visible = k_pos < n
    if window is not None:
        visible &= k_pos > n - 1 - window
    index = {
        "token_idx": torch.tensor([meta.query_start_loc[r] for r in rows], device=device),
        "blocks": blocks,
        "visible": visible,
    }
    meta.cache[key] = index
    return index


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, index: dict, spec: AttentionSpec) -> torch.Tensor:
    """q: [B, heads, dim] → [B, heads, dim]; reads only the blocks in index["blocks"]."""
    batch = q.shape[0]
    heads, dim = kv_cache.shape[-2:]
    blocks = index["blocks"]
    keys = kv_cache[0, blocks].reshape(batch, -1, heads, dim).transpose(1, 2).to(q.dtype)  # [B, kvh, L, d]
    values = kv_cache[1, blocks].reshape(batch, -1, heads, dim).transpose(1, 2).to(q.dtype)
    group = spec.num_heads // spec.num_kv_heads
    qh = q.view(batch, spec.num_kv_heads, group, 1, dim)
    scores = _scores(qh, keys, spec)  # [B, kvh, g, 1, L]
    scores = scores.masked_fill(~index["visible"][:, None, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = _grouped_matmul(probs, values)  # [B, kvh, g, 1, d]
    return out.reshape(batch, spec.num_heads, dim)
