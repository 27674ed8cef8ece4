"""Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4.7-Flash): the cache holds one latent per token.

kv_a_proj_with_mqa compresses a token to c_kv (kv_lora_rank, RMS-normed) and a shared rope key k_pe
(qk_rope_head_dim); kv_b_proj up-projects c_kv to every head's K_nope and V. The cache keeps only
[c_kv | k_pe] (576 values per token and layer in DeepSeek-V3, vs 2 x 128 heads x 192/128 expanded).

- Decode rows use the absorbed form: q_nope is folded through each head's K up-projection
  (q_lat = q_nope W_UK), so scores are taken against the latent itself; that is MQA with one "KV head"
  of dim kv_lora_rank + rope whose V is the same vector. The backend's paged decode runs it (on CPU the
  C kernel) over one cache plane viewed as both K and V; the first kv_lora_rank output dims are then
  folded through W_UV. Per token it reads the latent once instead of H expanded heads.
- Prefill rows expand: the sequence's latents are up-projected and attended as ordinary causal
  attention (fewer flops than the absorbed form when many queries share the keys), as vLLM does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from vllmpy.attention.base import AttentionMetadata, AttentionSpec
from vllmpy.attention.kv_storage import PagedKVCache, as_paged, element_bytes, scale_plane_elems
from vllmpy.attention.layer import PagedAttention
from vllmpy.attention.torch_paged import _gather_seq, _prefill
from vllmpy.engine.kv_cache_spec import FullAttentionSpec, KVCacheSpec
from vllmpy.kernels import block_kernels
from vllmpy.layers.linear import Linear, default_weight_loader
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.quantized import PackedTensor
from vllmpy.layers.rotary import CosSin, apply_rotary, rope_parameters, yarn_mscale

# DeepSeek's reference code builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Every position stays visible (a full-attention kind), but a position costs one latent vector of
    head_dim = kv_lora_rank + qk_rope_head_dim (num_kv_heads 1), not a K and a V."""

    @property
    def label(self) -> str:
        return f"MLA latent {self.head_dim}"

    @property
    def page_bytes(self) -> int:
        return round(self.block_size * self.head_dim * element_bytes(self.dtype, self.head_dim))

    def view(self, buffer: torch.Tensor, num_blocks: int) -> PagedKVCache:
        """The latent plane [num_blocks, block_size, 1, dim] (then an int8 cache's scale plane), seen as
        both K and V through a stride-0 leading axis: every K/V reader works on it unchanged."""
        shape = (num_blocks, self.block_size, 1, self.head_dim)
        values = math.prod(shape) * self.dtype.itemsize
        data = buffer[:values].view(self.dtype).view(shape).expand(2, *shape)
        if self.dtype != torch.int8:
            return PagedKVCache(data)
        scale_shape = shape[:-1] + (scale_plane_elems(self.head_dim),)
        scales = buffer[values:values + 2 * math.prod(scale_shape)].view(torch.float16).view(scale_shape)
        return PagedKVCache(data, scales.expand(2, *scale_shape))


def mla_softmax_scale(config: dict) -> float:
    """1/sqrt(qk_nope + qk_rope), times YaRN's mscale(factor, mscale_all_dim)^2 when the rope is stretched."""
    scale = (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]) ** -0.5
    params = rope_parameters(config)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        scale *= yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


# Up to this many decode rows the absorbed up-projections run on the file's blocks (vq_matmul_heads: Q8_0 reads
# ~4x fewer bytes than the float W_UK / W_UV); past it the float bmm's arithmetic wins. 16 heads, Q8_0, 1 thread,
# weights cycled past the 32 MiB L3 as a step's layers are, float bmm time over packed: q_nope W_UK (512 x 128 per
# head) 5.8 / 2.7 / 1.6 / 0.97x at 1 / 4 / 8 / 16 rows, W_UV (128 x 512) 5.0 / 2.7 / 1.8 / 1.13x.
HEADS_MAX_ROWS = 12


@dataclass(frozen=True)
class HeadBlocks:
    """Each head's [n, k] up-projection inside packed rows: head h's rows are first + h * stride .. + n."""

    packed: PackedTensor
    n: int
    first: int
    stride: int

    def matmul(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """out[:, h] = x[:, h] W[h]^T for float32 x [B, H, k] and out [B, H, n] (any row / head strides, each row
        contiguous) in one C call; False where the kernel is unbuilt or declined (out of memory)."""
        lib, row_bytes = block_kernels(), self.packed.data.shape[1]
        if lib is None or x.dtype != torch.float32 or x.stride(2) != 1 or out.stride(2) != 1:
            return False
        return bool(lib.vq_matmul_heads(
            self.packed.ggml_type, self.packed.data.data_ptr() + self.first * row_bytes, self.stride * row_bytes,
            row_bytes, x.shape[1], self.n, x.shape[2], x.data_ptr(), x.stride(1), x.stride(0), x.shape[0],
            out.data_ptr(), out.stride(1), out.stride(0), torch.get_num_threads()))


def dense_weight(linear: Linear) -> torch.Tensor:
    """A linear layer's weight as a dense float tensor, whether it loaded dense or stayed packed."""
    if isinstance(linear.packed, PackedTensor):
        return linear.packed.dequantize()
    return linear.weight.data


class MLAAttention(PagedAttention):
    """The cache layer: writes the latents, attends decode rows absorbed and prefill rows expanded.

    Its `spec` is the absorbed form's (num_heads over 1 KV head of the latent's dim); `absorb` takes
    kv_b_proj's weight once loaded."""

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float) -> None:
        super().__init__(AttentionSpec(num_heads, 1, kv_lora_rank + qk_rope_head_dim, scale))
        self.kv_lora_rank, self.nope_dim, self.v_dim = kv_lora_rank, qk_nope_head_dim, v_head_dim
        self.prefill_spec = AttentionSpec(num_heads, num_heads, qk_nope_head_dim + qk_rope_head_dim, scale)
        # Plain attributes, computed from kv_b_proj after loading: [H, nope, L] and [H, L, v].
        self.w_uk: torch.Tensor | None = None
        self.w_uv_t: torch.Tensor | None = None
        # The same up-projections on the file's blocks where it keeps them packed (`KVUpProjection.head_blocks`).
        self.uk_blocks: HeadBlocks | None = None
        self.uv_blocks: HeadBlocks | None = None

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return MLAAttentionSpec(block_size, 1, self.spec.head_dim, dtype)

    def load_kv_scale(self, which: str, tensor: torch.Tensor) -> None:
        """The latent is stored once, under the K scale (vLLM's MLA reads k_scale only)."""
        super().load_kv_scale(which, tensor)
        self.v_scale = self.k_scale

    def absorb(self, kv_b_weight: torch.Tensor) -> None:
        """Split kv_b_proj [H * (nope + v), L] into each head's K and V up-projections: strided views, not
        copies (bmm takes them as they are at the same speed; copies would triple the weight's memory:
        7.6 GiB more on DeepSeek-V3's 61 layers in float32)."""
        heads = self.spec.num_heads
        w = kv_b_weight.view(heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk = w[:, :self.nope_dim]
        self.w_uv_t = w[:, self.nope_dim:].transpose(1, 2)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                kv_cache: PagedKVCache | torch.Tensor, meta: AttentionMetadata, kv_b_proj: Linear) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated), latent [T, L + rope] ([c_kv normed | k_pe
        rotated]) -> [T, H, v]. Both halves of the pair-view are written (one plane: the same slots)."""
        cache = as_paged(kv_cache)
        entry = latent.unsqueeze(1)
        stored, _ = cache.write(entry, entry, meta.slot_mapping)  # as the cache holds it (fp8 / int8)
        out = q_nope.new_empty(q_nope.shape[0], self.spec.num_heads, self.v_dim)
        if meta.decode is not None:
            out[meta.decode.token_idx] = self._absorbed_decode(q_nope, q_pe, cache, meta)
        for seq in meta.prefill.seqs if meta.prefill is not None else ():
            start, end, seq_len = seq.start, seq.end, seq.seq_len
            if seq_len == end - start:
                context = stored[start:end, 0]
            else:
                context = _gather_seq(cache, meta, seq.row, 0, seq_len, q_nope.dtype)[0][:, 0]
            out[start:end] = self._expanded(q_nope[start:end], q_pe[start:end], context, seq_len, kv_b_proj)
        return out

    def _absorbed_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: PagedKVCache,
                         meta: AttentionMetadata) -> torch.Tensor:
        """The decode rows' outputs [B, H, v]: MQA over the latent with W_UK / W_UV folded in. The absorbed
        q / out hold only the decode tokens, so a long prefill in the same step costs nothing here."""
        tokens, rank = meta.decode.token_idx, self.kv_lora_rank
        q_sel = q_nope[tokens]
        q_abs = q_nope.new_empty(q_sel.shape[0], self.spec.num_heads, self.spec.head_dim)  # [B, H, L + rope]
        q_abs[:, :, rank:] = q_pe[tokens]
        if not self._on_blocks(self.uk_blocks, q_sel, q_abs[:, :, :rank]):
            q_abs[:, :, :rank] = torch.bmm(q_sel.transpose(0, 1), self.w_uk.to(q_sel.dtype)).transpose(0, 1)
        out_lat = torch.empty_like(q_abs)
        meta.backend.decode(q_abs, cache, meta, self.spec, out_lat)
        lat = out_lat[:, :, :rank]  # V is the latent part of the entry
        out = lat.new_empty(lat.shape[0], self.spec.num_heads, self.v_dim)
        if not self._on_blocks(self.uv_blocks, lat, out):
            out = torch.bmm(lat.transpose(0, 1), self.w_uv_t.to(lat.dtype)).transpose(0, 1)
        return out

    @staticmethod
    def _on_blocks(blocks: HeadBlocks | None, x: torch.Tensor, out: torch.Tensor) -> bool:
        """out = x's heads through their packed up-projections, where packed and the batch is small enough."""
        return blocks is not None and x.shape[0] <= HEADS_MAX_ROWS and blocks.matmul(x, out)

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, context: torch.Tensor, seq_len: int,
                  kv_b_proj: Linear) -> torch.Tensor:
        """One sequence's last q_len queries over its context latents [seq_len, L + rope], up-projected."""
        heads = self.spec.num_heads
        kv = kv_b_proj(context[:, :self.kv_lora_rank]).view(seq_len, heads, self.nope_dim + self.v_dim)
        k_nope, values = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_pe = context[:, None, self.kv_lora_rank:].expand(seq_len, heads, -1)
        keys = torch.cat((k_nope, k_pe), dim=-1)
        return _prefill(torch.cat((q_nope, q_pe), dim=-1), keys, values.contiguous(), seq_len, self.prefill_spec)


class KVUpProjection(Linear):
    """kv_b_proj, [heads * (nope + v), kv_lora_rank]: whole (HF), or llama.cpp's halves (shards "k_b", stored
    transposed [heads, kv_lora_rank, nope], and "v_b", [heads, v, kv_lora_rank]) placed in every head's rows."""

    def __init__(self, kv_lora_rank: int, heads: int, nope_dim: int, v_dim: int) -> None:
        super().__init__(kv_lora_rank, heads * (nope_dim + v_dim))
        self.heads, self.nope_dim, self.v_dim = heads, nope_dim, v_dim
        self.shard_offsets = {"k_b": (0, nope_dim), "v_b": (nope_dim, v_dim)}  # rows within each head's block
        self.halves: dict[str, PackedTensor] = {}  # llama.cpp's k_b / v_b as the file packs them

    def load_packed(self, weight: PackedTensor, shard_id: int | str | None = None) -> None:
        """Whole kv_b stays packed (a Linear's); a packed k_b / v_b ([heads * rows, cols], `to_packed`'s head
        stack) is kept for the absorbed decode and also expanded into the float weight prefill multiplies by
        (k_b's rows run along kv_lora_rank, not along the reduction prefill's K up-projection needs)."""
        if shard_id is None:
            super().load_packed(weight)
            return
        self.halves[shard_id] = weight
        self.weight_loader(self.weight, weight.dequantize().view(self.heads, -1, weight.shape[1]), shard_id)

    def head_blocks(self) -> tuple[HeadBlocks | None, HeadBlocks | None]:
        """(W_UK, W_UV) on packed blocks whose rows run along each product's reduction: k_b ([L, nope] per
        head, for q_nope W_UK) and v_b ([v, L]) or whole kv_b's V rows; whole kv_b's K rows run along L (None)."""
        rank = self.in_features
        if self.halves:
            k_b, v_b = self.halves.get("k_b"), self.halves.get("v_b")
            return (None if k_b is None else HeadBlocks(k_b, rank, 0, rank),
                    None if v_b is None else HeadBlocks(v_b, self.v_dim, 0, self.v_dim))
        if self.packed is not None and self.packed.input_perm is None:
            return None, HeadBlocks(self.packed, self.v_dim, self.nope_dim, self.nope_dim + self.v_dim)
        return None, None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None) -> None:
        if shard_id is None:
            default_weight_loader(param, loaded)
            return
        offset, size = self.shard_offsets[shard_id]
        part = loaded.transpose(1, 2) if shard_id == "k_b" else loaded
        target = param.data.view(self.heads, -1, param.shape[1])[:, offset:offset + size]
        if target.shape != part.shape:
            raise ValueError(f"shape mismatch for {shard_id}: parameter {tuple(target.shape)} vs checkpoint "
                             f"{tuple(part.shape)}{' (transposed)' if shard_id == 'k_b' else ''}")
        target.copy_(part)


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek's attention block: q through q_lora (q_a_proj -> norm -> q_b_proj) or q_proj when
    q_lora_rank is null; kv_a_proj_with_mqa -> (c_kv, k_pe); rope on the rope parts; o_proj.

    rope_interleaved decides only the pair layout of q_pe / k_pe (the model's rotary applies it)."""

    layer_type = "full_attention"
    rope = True

    def __init__(self, config: dict, scale: float | None = None) -> None:
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        self.kv_lora_rank, self.q_lora_rank = config["kv_lora_rank"], config.get("q_lora_rank")
        self.nope_dim, self.rope_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
        self.v_dim = config.get("v_head_dim") or hidden // heads
        self.num_heads = heads
        self.head_dim = self.rope_dim  # what the model's rotary rotates
        bias = bool(config.get("attention_bias", False))
        q_out = heads * (self.nope_dim + self.rope_dim)
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, q_out)
        else:
            self.q_proj = Linear(hidden, q_out)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = KVUpProjection(self.kv_lora_rank, heads, self.nope_dim, self.v_dim)
        self.o_proj = Linear(heads * self.v_dim, hidden, bias=bias)
        self.attn = MLAAttention(heads, self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim,
                                 scale or mla_softmax_scale(config))

    def finish_loading(self) -> None:
        self.attn.absorb(dense_weight(self.kv_b_proj))
        self.attn.uk_blocks, self.attn.uv_blocks = self.kv_b_proj.head_blocks()

    def forward(self, x: torch.Tensor, cos_sin: CosSin, kv_cache: PagedKVCache | torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe = apply_rotary(q_pe.contiguous(), *cos_sin)
        k_pe = apply_rotary(k_pe.contiguous().unsqueeze(1), *cos_sin)[:, 0]
        latent = torch.cat((self.kv_a_layernorm(c_kv.contiguous()), k_pe), dim=-1)
        out = self.attn(q_nope, q_pe, latent, kv_cache, meta, self.kv_b_proj)
        return self.o_proj(out.reshape(-1, self.num_heads * self.v_dim))
