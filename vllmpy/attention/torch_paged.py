"""Portable paged attention in plain torch (any device), with a C decode kernel on CPU.

K/V are written into the paged cache through the slot mapping. Decode rows (one new token) are
attended in one batched call: on CPU by the C kernel (vllmpy/kernels/paged_attention.c), which reads
K/V in place through the block tables; elsewhere, or where the kernel did not build, in torch over a
gathered copy of the blocks each row needs (only the window's blocks for sliding layers). Prefill rows
attend one sequence at a time, reading the in-flight K/V directly when the sequence has no cached
context. Non-causal (encoder) layers always get whole sequences in one step and never decode, so they
attend the in-flight K/V and leave the cache alone.
"""
from __future__ import annotations

import ctypes

import torch

from vllmpy.attention.base import AttentionMetadata, AttentionSpec
from vllmpy.kernels import attention_kernels
from vllmpy.layers.dense import dense_linear

# Cache dtypes the C decode kernel reads, by its cache_dtype code.
_KERNEL_CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


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
        _attend_decode_rows(q, kv_cache, meta, spec, out)
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
    folded = a.reshape(*lead, group * rows, inner)
    if len(lead) == 1:  # one sequence: a matmul per KV head through dense_linear (oneDNN: ~2x bmm on x86)
        heads = [dense_linear(folded[h], b[h].transpose(0, 1)) for h in range(lead[0])]
        out = heads[0].unsqueeze(0) if len(heads) == 1 else torch.stack(heads)
    else:
        out = torch.matmul(folded, b)
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
    # torch's CPU SDPA takes its unfused math path whenever enable_gqa is set: the grouped path is faster there.
    if (not spec.logit_soft_cap and spec.sliding_window is None and q_len == seq_len
            and (group == 1 or q.device.type != "cpu")):
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


def _attend_decode_rows(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, spec: AttentionSpec,
                        out: torch.Tensor) -> None:
    """out[t] for the decode rows' tokens t: the C kernel where it applies, else the torch path."""
    lib = _decode_kernel(q, kv_cache)
    if lib is not None:
        _kernel_decode(lib, q, kv_cache, _decode_batch(meta, q.device), spec, out)
        return
    index = _decode_index(meta, spec.sliding_window, q.device)
    out[index["token_idx"]] = _decode(q[index["token_idx"]], kv_cache, index, spec)


def _decode_kernel(q: torch.Tensor, kv_cache: torch.Tensor) -> ctypes.CDLL | None:
    """The C decode kernel if it can serve this call: CPU tensors, a contiguous cache of a dtype it
    reads, and the library built. Otherwise None (CUDA, no compiler) and torch attends."""
    if q.device.type != "cpu" or kv_cache.dtype not in _KERNEL_CACHE_DTYPES or not kv_cache.is_contiguous():
        return None
    return attention_kernels()


def _decode_batch(meta: AttentionMetadata, device: torch.device) -> dict:
    """The decode rows' token indices, block tables and context lengths as int64 tensors, built once per
    step (memoised in meta.cache) for every layer, both window kinds and both decode paths."""
    key = ("decode-batch",)
    if key in meta.cache:
        return meta.cache[key]
    rows = meta.decode_rows
    batch = {
        "token_idx": torch.tensor([meta.query_start_loc[r] for r in rows], dtype=torch.int64, device=device),
        "rows": torch.arange(len(rows), dtype=torch.int64, device=device),  # for q/out already gathered
        "tables": meta.block_tables[rows].to(torch.int64).contiguous(),  # [B, max_blocks]
        "seq_lens": torch.tensor([meta.seq_lens[r] for r in rows], dtype=torch.int64, device=device),
    }
    meta.cache[key] = batch
    return batch


def _kernel_decode(lib: ctypes.CDLL, q: torch.Tensor, kv_cache: torch.Tensor, batch: dict, spec: AttentionSpec,
                   out: torch.Tensor) -> None:
    """The C kernel's decode attention: q rows batch["token_idx"] read, the same rows of out written.

    Float32 q/out laid out [heads, dim] per token are used in place; otherwise (a bf16/f16 model) only
    the decode rows are gathered to float32 and the result cast back, so prefill tokens in the same
    step cost nothing here.
    """
    tokens = batch["token_idx"]
    in_place = all(t.dtype == torch.float32 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, out))
    q32 = q if in_place else q[tokens].float()
    out32 = out if in_place else torch.empty(q32.shape, dtype=torch.float32)
    rows = tokens if in_place else batch["rows"]
    tables, seq_lens = batch["tables"], batch["seq_lens"]
    status = lib.vq_paged_decode(
        q32.data_ptr(), q32.stride(0), rows.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
        _KERNEL_CACHE_DTYPES[kv_cache.dtype], tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), len(rows),
        kv_cache.shape[2], spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scale, spec.logit_soft_cap or 0.0,
        spec.sliding_window or 0, out32.data_ptr(), out32.stride(0), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"vq_paged_decode failed ({status})")
    if not in_place:
        out[tokens] = out32.to(out.dtype)


def _decode_index(meta: AttentionMetadata, window: int | None, device: torch.device) -> dict:
    """Block indices and mask for the torch path's batched decode rows; memoised per step and window."""
    key = ("decode", window)
    if key in meta.cache:
        return meta.cache[key]
    batch = _decode_batch(meta, device)
    bs = meta.block_size
    seq_lens = [meta.seq_lens[r] for r in meta.decode_rows]
    # First block each row needs: all for full attention, only the window's for sliding layers.
    first = [0 if window is None else max(0, (n - window)) // bs for n in seq_lens]
    last = [-(-n // bs) for n in seq_lens]
    width = max(b - a for a, b in zip(first, last))
    offsets = torch.arange(width, device=device)
    first_t = torch.tensor(first, device=device)
    table = batch["tables"]
    cols = (first_t[:, None] + offsets[None, :]).clamp(max=table.shape[1] - 1)
    blocks = torch.gather(table, 1, cols)  # [B, width]
    k_pos = (first_t[:, None] * bs + torch.arange(width * bs, device=device)[None, :])
    n = batch["seq_lens"][:, None]
    visible = k_pos < n
    if window is not None:
        visible &= k_pos > n - 1 - window
    index = {**batch, "blocks": blocks, "visible": visible}
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
