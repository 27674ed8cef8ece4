"""Portable paged attention in plain torch (any device), with a C decode kernel on CPU.

K/V are written into the paged cache through the slot mapping (where the C kernel attends the decode rows of a
float cache of the model's dtype, by the kernel, in the same call). Decode rows (one new token, or a
speculative verification's few: each token then decodes its own causal prefix) are attended in one
batched call: on CPU by the C kernel (vllmpy/kernels/paged_attention.c), which reads K/V in place
through the block tables; elsewhere, or where the kernel did not build, in torch over a gathered copy
of the blocks each row needs. Prefill rows attend one sequence at a time, reading the
in-flight K/V directly (as the cache stores them) when the sequence has no cached context. Sliding layers read only their
window's blocks on every path: blocks before it may already be back in the pool (their table entries
are placeholders). Non-causal (encoder) layers always get whole sequences in one step and never
decode, so they attend the in-flight K/V and leave the cache alone.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from vllmpy.attention.base import AttentionMetadata, AttentionSpec, DecodeBatch, DecodeIndex, DecodeView
from vllmpy.attention.kv_storage import PagedKVCache, as_paged
from vllmpy.kernels import attention_kernels
from vllmpy.layers.dense import dense_linear

# Cache dtypes the C decode kernel reads, by its cache_dtype code.
_KERNEL_CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3,
                        torch.float8_e5m2: 4, torch.int8: 5}
# Cache dtypes it also writes the step's K/V into (stored as the model computed them: a copy).
_KERNEL_WRITE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: PagedKVCache | torch.Tensor,
                    meta: AttentionMetadata, spec: AttentionSpec, use_kernel: bool = True) -> torch.Tensor:
    """q: [T, heads, dim], k/v: [T, kv_heads, dim] (this step's tokens) → [T, heads, dim].

    use_kernel=False keeps the decode rows on the torch path even where the C kernel could serve them.
    A quantized cache is read as stored everywhere: this step's K/V as written (kv_storage.py), cached
    context converted block by block as a prefill row gathers it (only the blocks the step reads), decode
    rows by the C kernel one row at a time in place (or the torch path converting the blocks it gathers).
    """
    if not spec.causal:
        return _encoder_attention(q, k, v, meta, spec)
    kv_cache = as_paged(kv_cache)
    out = torch.empty_like(q)
    decode = meta.decode
    lib = _decode_kernel(q, kv_cache) if use_kernel and decode is not None else None
    if lib is not None and _kernel_writes(k, v, kv_cache):  # the step's K/V stored as they are: in the same call
        _kernel_decode(lib, q, kv_cache, decode, spec, out, decode.token_idx, (k, v, meta.slot_mapping))
    else:
        k, v = kv_cache.write(k, v, meta.slot_mapping)
        if decode is not None:
            _attend_decode_rows(q, kv_cache, meta, spec, out, decode.token_idx, use_kernel)
    for seq in meta.prefill.seqs if meta.prefill is not None else ():
        start, end, seq_len = seq.start, seq.end, seq.seq_len
        key_start = 0
        if seq_len == end - start:  # no cached context: attend this step's K/V directly
            keys, values = k[start:end], v[start:end]
        else:
            if spec.sliding_window is not None:  # from the block holding the first query's oldest key
                first_key = max(0, seq_len - (end - start) - spec.sliding_window + 1)
                key_start = first_key // meta.block_size * meta.block_size
            keys, values = _gather_seq(kv_cache, meta, seq.row, key_start, seq_len, q.dtype)
        out[start:end] = _prefill(q[start:end], keys, values, seq_len, spec, key_start, seq.spans)
    return out


def _encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                       spec: AttentionSpec) -> torch.Tensor:
    """Bidirectional attention within each sequence; the scheduler gives an encoder whole prompts only
    (each a prefill row: none extends a context)."""
    out = torch.empty_like(q)
    seqs = meta.prefill.seqs if meta.prefill is not None else ()
    if meta.decode is not None or any(seq.seq_len != seq.end - seq.start for seq in seqs):
        raise RuntimeError("an encoder sequence was split across steps; chunked prefill and prefix "
                           "caching must be off for non-causal models")
    for seq in seqs:
        out[seq.start:seq.end] = _prefill(q[seq.start:seq.end], k[seq.start:seq.end], v[seq.start:seq.end],
                                          seq.end - seq.start, spec)
    return out


def _gather_seq(kv_cache: PagedKVCache, meta: AttentionMetadata, row: int, key_start: int,
                seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of positions key_start (a block boundary) .. seq_len - 1 of one sequence, in `dtype`."""
    first, num_blocks = key_start // meta.block_size, -(-seq_len // meta.block_size)
    blocks = meta.block_tables[row, first:num_blocks]
    heads, dim = kv_cache.data.shape[-2:]
    keys, values = kv_cache.gather(blocks, dtype)
    return keys.reshape(-1, heads, dim)[:seq_len - key_start], values.reshape(-1, heads, dim)[:seq_len - key_start]


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
             spec: AttentionSpec, key_start: int = 0, spans: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
    """q: the sequence's last q_len positions; keys/values: its positions key_start .. seq_len - 1.
    Inside each of `spans` every position sees every other (then the sliding window still applies)."""
    q_len = q.shape[0]
    group = spec.num_heads // spec.num_kv_heads
    # torch's CPU SDPA takes its unfused math path whenever enable_gqa is set: the grouped path is faster there.
    if (not spec.logit_soft_cap and spec.sliding_window is None and q_len == seq_len and not spans
            and spec.sinks is None and spec.chunk_size is None and (group == 1 or q.device.type != "cpu")):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1).to(q.dtype), values.transpose(0, 1).to(q.dtype),
            is_causal=spec.causal, scale=spec.scale, enable_gqa=group > 1)
        return out.transpose(0, 1)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(key_start, seq_len, device=q.device)[None, :]
    visible = (k_pos <= q_pos if spec.causal
               else torch.ones(q_len, seq_len - key_start, dtype=torch.bool, device=q.device))
    for span_start, span_end in spans:  # transformers' token_type_ids mask: OR(causal, same image)
        visible |= (q_pos >= span_start) & (q_pos < span_end) & (k_pos >= span_start) & (k_pos < span_end)
    if spec.sliding_window is not None:
        visible &= k_pos > q_pos - spec.sliding_window
    if spec.chunk_size is not None:  # Llama 4's local layers: keys of the query's own chunk
        visible &= k_pos // spec.chunk_size == q_pos // spec.chunk_size
    qh = q.view(q_len, spec.num_kv_heads, group, -1).permute(1, 2, 0, 3)  # [kvh, g, Lq, d]
    scores = _scores(qh, keys.transpose(0, 1).to(q.dtype), spec)  # [kvh, g, Lq, Lk]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = _softmax(scores, spec).to(q.dtype)
    out = _grouped_matmul(probs, values.transpose(0, 1).to(q.dtype))  # [kvh, g, Lq, d]
    return out.permute(2, 0, 1, 3).reshape(q_len, spec.num_heads, -1)


def _softmax(scores: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """fp32 softmax over the keys (last dim of [..., kv_heads, group, Lq, Lk]); with sinks, each query
    head's sink logit joins the denominator and takes no value (gpt-oss)."""
    scores = scores.float()
    if spec.sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = spec.sinks.float().view(spec.num_kv_heads, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _attend_decode_rows(q: torch.Tensor, kv_cache: PagedKVCache, meta: AttentionMetadata, spec: AttentionSpec,
                        out: torch.Tensor, tokens: torch.Tensor, use_kernel: bool) -> None:
    """out[t] for the decode tokens t (`tokens`: their rows of q / out, one per decode token): the C kernel
    where it applies, else the torch path over the view's index the backend built with the metadata (the
    CPU backend builds none: its torch path runs only where the kernel cannot, and indexes on the spot)."""
    lib = _decode_kernel(q, kv_cache) if use_kernel else None
    if lib is not None:
        _kernel_decode(lib, q, kv_cache, meta.decode, spec, out, tokens)
        return
    index = meta.decode_index.get(spec.decode_view) or decode_index(meta.decode, meta.block_size, spec.decode_view)
    out[tokens] = _decode(q[tokens], kv_cache, index, spec)


def _decode_kernel(q: torch.Tensor, kv_cache: PagedKVCache) -> ctypes.CDLL | None:
    """The C decode kernel if it can serve this call: CPU tensors, a contiguous cache of a dtype it
    reads, and the library built. Otherwise None (CUDA, no compiler) and torch attends."""
    # The kernel reads the K and V planes separately: each must be dense (MLA's are one plane seen twice).
    if (q.device.type != "cpu" or kv_cache.dtype not in _KERNEL_CACHE_DTYPES
            or not (kv_cache.planes[0].is_contiguous() and kv_cache.planes[1].is_contiguous())):
        return None
    return attention_kernels()


def _heads_dense(t: torch.Tensor) -> bool:
    """[tokens, heads, dim] with each token's heads contiguous (tokens at any stride): what the kernel reads."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


def _kernel_writes(k: torch.Tensor, v: torch.Tensor, kv_cache: PagedKVCache) -> bool:
    """Whether the decode kernel can store this step's k / v itself: a float cache of their dtype (a row
    copy; fp8 / int8 caches quantize in torch) and each token's heads contiguous."""
    return (k.dtype == kv_cache.dtype and v.dtype == k.dtype and k.dtype in _KERNEL_WRITE_DTYPES
            and _heads_dense(k) and _heads_dense(v))


def _kernel_decode(lib: ctypes.CDLL, q: torch.Tensor, kv_cache: PagedKVCache, batch: DecodeBatch,
                   spec: AttentionSpec, out: torch.Tensor, tokens: torch.Tensor,
                   new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """The C kernel's decode attention: q rows `tokens` (one per decode token of batch) read, the same
    rows of out written; `new` (k, v, slot_mapping: `_kernel_writes` holds): the step's K/V written to
    their slots first, in the same call.

    Float32 q/out laid out [heads, dim] per token are used in place; otherwise (a bf16/f16 model) only
    the decode rows are gathered to float32 and the result cast back, so prefill tokens in the same
    step cost nothing here.
    """
    in_place = q.dtype == torch.float32 and out.dtype == torch.float32 and _heads_dense(q) and _heads_dense(out)
    q32 = q if in_place else q[tokens].float()
    out32 = out if in_place else torch.empty(q32.shape, dtype=torch.float32)
    rows = tokens if in_place else batch.rows
    tables, seq_lens = batch.tables, batch.seq_lens
    (keys, values), scales = kv_cache.planes, kv_cache.scales  # scales: an int8 cache's, else None
    sinks = None if spec.sinks is None else spec.sinks.float().contiguous()
    written = (None, 0, None, 0, None, 0) if new is None else (
        new[0].data_ptr(), new[0].stride(0), new[1].data_ptr(), new[1].stride(0), new[2].data_ptr(), len(new[2]))
    status = lib.vq_paged_decode(
        q32.data_ptr(), q32.stride(0), rows.data_ptr(), keys.data_ptr(), values.data_ptr(),
        _KERNEL_CACHE_DTYPES[kv_cache.dtype], kv_cache.k_scale, kv_cache.v_scale,
        None if scales is None else scales[0].data_ptr(), None if scales is None else scales[1].data_ptr(),
        tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), len(rows), kv_cache.block_size, spec.num_heads,
        spec.num_kv_heads, spec.head_dim, spec.scale, spec.logit_soft_cap or 0.0,
        spec.sliding_window or 0, None if sinks is None else sinks.data_ptr(), spec.chunk_size or 0,
        out32.data_ptr(), out32.stride(0), *written, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"vq_paged_decode failed ({status})")
    if not in_place:
        out[tokens] = out32.to(out.dtype)


def decode_index(batch: DecodeBatch, block_size: int, view: DecodeView) -> DecodeIndex:
    """Block indices and mask of the torch path's batched decode for one (window, chunk) view: each token
    reads from the first block its view needs (all for full attention) to the last of its context."""
    window, chunk = view
    lens = batch.seq_lens
    device = lens.device
    first = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0) // block_size
    if chunk is not None:  # from the block holding the start of the token's chunk
        first = torch.maximum(first, (lens - 1) // chunk * chunk // block_size)
    last = (lens + block_size - 1) // block_size
    width = int((last - first).max())
    # Past its last block a token re-reads that block (masked): padding and placeholders are never read.
    cols = torch.minimum(first[:, None] + torch.arange(width, device=device)[None, :], last[:, None] - 1)
    blocks = torch.gather(batch.tables, 1, cols)  # [B, width]
    k_pos = first[:, None] * block_size + torch.arange(width * block_size, device=device)[None, :]
    n = lens[:, None]
    visible = k_pos < n
    if window is not None:
        visible &= k_pos > n - 1 - window
    if chunk is not None:
        visible &= k_pos >= (n - 1) // chunk * chunk
    return DecodeIndex(blocks, visible)


def _decode(q: torch.Tensor, kv_cache: PagedKVCache, index: DecodeIndex, spec: AttentionSpec) -> torch.Tensor:
    """q: [B, heads, dim] → [B, heads, dim]; reads (and converts) only the blocks in index.blocks."""
    batch = q.shape[0]
    heads, dim = kv_cache.data.shape[-2:]
    keys, values = kv_cache.gather(index.blocks, q.dtype)
    keys = keys.reshape(batch, -1, heads, dim).transpose(1, 2)  # [B, kvh, L, d]
    values = values.reshape(batch, -1, heads, dim).transpose(1, 2)
    group = spec.num_heads // spec.num_kv_heads
    qh = q.view(batch, spec.num_kv_heads, group, 1, dim)
    scores = _scores(qh, keys, spec)  # [B, kvh, g, 1, L]
    scores = scores.masked_fill(~index.visible[:, None, None, None, :], float("-inf"))
    probs = _softmax(scores, spec).to(q.dtype)
    out = _grouped_matmul(probs, values)  # [B, kvh, g, 1, d]
    return out.reshape(batch, spec.num_heads, dim)
