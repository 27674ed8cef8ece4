"""Each format's on-disk layout and its dequantization, written from the formats' specifications
independently of vllmpy/loader/quantization (bit shifts here, byte views there).

GPTQ: qweight [in * bits / 32, out] int32, input i of a word at bits (i % per_word) * bits; qzeros
[groups, out * bits / 32] along the output; scales [groups, out] fp16; g_idx [in]; w = s[g] * (q - z[g]);
checkpoint_format "gptq" stores z - 1. AWQ (GEMM): qweight [in, out / 8] and qzeros [groups, out / 8],
column 8 w + ORDER[n] in nibble n, ORDER = 0 2 4 6 1 3 5 7 (AutoAWQ's pack). compressed-tensors:
pack-quantized packs (q + 2^(bits-1)) 32 values to `bits` words along the input; zero points the same
along the output. fp8: e4m3 codes times the scale (per tensor, per row, or per [128, 128] block).
"""
from __future__ import annotations

import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantize(w: torch.Tensor, bits: int, group: int, sym: bool, generator: torch.Generator | None = None):
    """Round-to-nearest codes q [out, in] in [0, 2^bits), zeros and fp16 scales [out, groups]."""
    out, columns = w.shape
    group = columns if group == -1 else group
    g = w.reshape(out, columns // group, group)
    top = (1 << bits) - 1
    if sym:
        scales = (g.abs().amax(-1) / (top // 2)).clamp_min(1e-4).half()
        zeros = torch.full(scales.shape, 1 << (bits - 1), dtype=torch.int32)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scales = ((hi - lo) / top).clamp_min(1e-4).half()
        zeros = torch.round(-lo / scales.float()).clamp(0, top).to(torch.int32)
    q = torch.round(g / scales.float()[..., None]) + zeros[..., None]
    return q.clamp(0, top).to(torch.int32).reshape(out, columns), zeros, scales


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, n] unsigned -> [rows, n * bits / 32] int32, value j of each word at bit j * bits."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(values.shape[0], -1, per)
    word = sum(v[..., j] << (j * bits) for j in range(per))
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (j * bits)) & ((1 << bits) - 1) for j in range(per)], -1).reshape(words.shape[0], -1)


def expand_groups(values: torch.Tensor, columns: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """[out, groups] -> [out, columns]: the value of each column's group."""
    if g_idx is None:
        g_idx = torch.arange(columns) // (columns // values.shape[1])
    return values[:, g_idx.long()]


# ---- GPTQ
def gptq_tensors(q, zeros, scales, bits: int, g_idx: torch.Tensor | None, v1: bool) -> dict[str, torch.Tensor]:
    """q [out, in] (columns in input order), zeros / scales [out, groups] (group ids of g_idx)."""
    out, columns = q.shape
    groups = scales.shape[1]
    g_idx = torch.arange(columns) // (columns // groups) if g_idx is None else g_idx
    stored = zeros - 1 if v1 else zeros
    stored = stored & ((1 << bits) - 1)
    return {"qweight": _pack(q.contiguous(), bits).t().contiguous(),
            "qzeros": _pack(stored.t().contiguous(), bits), "scales": scales.t().contiguous(),
            "g_idx": g_idx.to(torch.int32)}


def gptq_dequantize(t: dict[str, torch.Tensor], bits: int, v1: bool) -> torch.Tensor:
    q = _unpack(t["qweight"].t().contiguous(), bits)  # [out, in]
    zeros = _unpack(t["qzeros"], bits)[:, :t["scales"].shape[1]].t()  # [out, groups]
    if v1:
        zeros = zeros + 1
    scales = t["scales"].t().float()
    g = t["g_idx"].long()
    return scales[:, g] * (q - zeros[:, g]).float()


# ---- AWQ
def awq_tensors(q, zeros, scales) -> dict[str, torch.Tensor]:
    def pack(values: torch.Tensor) -> torch.Tensor:  # [rows, out] -> [rows, out / 8], AutoAWQ's nibble order
        v = values.to(torch.int64).reshape(values.shape[0], -1, 8)
        word = sum(v[..., AWQ_ORDER[n]] << (4 * n) for n in range(8))
        return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)

    return {"qweight": pack(q.t().contiguous()), "qzeros": pack(zeros.t().contiguous()),
            "scales": scales.t().contiguous()}


def awq_dequantize(t: dict[str, torch.Tensor]) -> torch.Tensor:
    def unpack(words: torch.Tensor) -> torch.Tensor:
        nibbles = _unpack(words, 4).reshape(words.shape[0], -1, 8)
        cols = torch.empty_like(nibbles)
        for n in range(8):
            cols[..., AWQ_ORDER[n]] = nibbles[..., n]
        return cols.reshape(words.shape[0], -1)

    q, zeros = unpack(t["qweight"]), unpack(t["qzeros"])  # [in, out], [groups, out]
    group = q.shape[0] // zeros.shape[0]
    scales = t["scales"].float().repeat_interleave(group, 0)
    return (scales * (q - zeros.repeat_interleave(group, 0)).float()).t()


# ---- compressed-tensors
def ct_packed_tensors(q, zeros, scales, bits: int, sym: bool, g_idx=None) -> dict[str, torch.Tensor]:
    """q, zeros unsigned; the file's signed values are q - 2^(bits-1), packed with that offset back on."""
    out, columns = q.shape
    t = {"weight_packed": _pack(q, bits), "weight_scale": scales.contiguous(),
         "weight_shape": torch.tensor([out, columns])}
    if not sym:
        t["weight_zero_point"] = _pack(zeros.t().contiguous(), bits).t().contiguous()
    if g_idx is not None:
        t["weight_g_idx"] = g_idx.to(torch.int32)
    return t


def ct_int_dequantize(t: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    center = 1 << (bits - 1)
    out, columns = (int(v) for v in t["weight_shape"])
    q = _unpack(t["weight_packed"], bits)[:, :columns] - center
    scales = t["weight_scale"].float()
    zeros = (_unpack(t["weight_zero_point"].t().contiguous(), bits)[:, :out].t() - center
             if "weight_zero_point" in t else torch.zeros_like(scales, dtype=torch.int64))
    g_idx = t.get("weight_g_idx")
    return expand_groups(scales, columns, g_idx) * (q - expand_groups(zeros, columns, g_idx)).float()


# ---- fp8
def fp8_quantize(w: torch.Tensor, strategy: str, block=(128, 128)):
    """e4m3 codes [out, in] and an fp32 scale: per tensor [1], per row [out, 1] or per block."""
    out, columns = w.shape
    if strategy == "tensor":
        scale = (w.abs().amax() / 448).reshape(1)
        full = scale.expand(out, columns)
    elif strategy == "channel":
        scale = w.abs().amax(1, keepdim=True) / 448
        full = scale.expand(out, columns)
    else:
        rows, cols = block
        pad = torch.nn.functional.pad(w, (0, -columns % cols, 0, -out % rows))
        scale = pad.reshape(pad.shape[0] // rows, rows, -1, cols).abs().amax((1, 3)) / 448
        full = scale.repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :columns]
    return (w / full).to(torch.float8_e4m3fn), scale.float()


def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor, block=None) -> torch.Tensor:
    out, columns = codes.shape
    if block is None:
        full = scale.reshape(-1, 1).expand(out, columns) if scale.numel() > 1 else scale.reshape(1, 1)
    else:
        full = scale.repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :columns]
    return codes.float() * full
