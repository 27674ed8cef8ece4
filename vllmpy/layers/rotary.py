"""Rotary position embeddings with the scaling types HF configs name.

Two layouts: rotate-half (neox; Llama and most families) and interleaved pairs (GPT-J; Cohere, GLM-4).
Partial rotary rotates the first `rotary_dim` dims of each head and passes the rest through.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.kernels import layer_kernels
from vllmpy.layers.norm import RMSNorm

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the C rotation takes (vq_rope, vq_rope_bf16)


def rope_parameters(config: dict, layer_type: str | None = None) -> dict:
    """Rope settings for one layer type, from either config convention.

    transformers <= 4 writes `rope_theta` + `rope_scaling` (+ Gemma 3's `rope_local_base_freq`);
    transformers 5 writes `rope_parameters`, keyed by layer type for models that mix them.
    """
    params = config.get("rope_parameters")
    if params:
        if layer_type is not None and layer_type in params:
            params = params[layer_type]
        elif "rope_theta" not in params:
            params = params.get("full_attention", next(iter(params.values())))
        return dict(params)
    theta = config.get("rope_theta", 10000.0)
    if layer_type == "sliding_attention" and "rope_local_base_freq" in config:
        return {"rope_type": "default", "rope_theta": config["rope_local_base_freq"]}
    scaling = dict(config.get("rope_scaling") or {})
    scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    scaling["rope_theta"] = theta
    return scaling


def rotary_dim(config: dict, head_dim: int, layer_type: str | None = None) -> int:
    """head_dim * partial_rotary_factor, from rope_parameters (transformers 5) or the top level (older configs)."""
    factor = rope_parameters(config, layer_type).get("partial_rotary_factor", config.get("partial_rotary_factor"))
    return int(head_dim * (1.0 if factor is None else factor))


def _inv_freq(dim: int, params: dict, max_position: int, serving_len: int | None) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    # Built on the CPU explicitly: models are constructed under the meta device.
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    kind = params.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, params), 1.0
    if kind == "yarn":
        return _yarn(dim, base, params, max_position)
    if kind == "longrope":
        return _longrope(dim, base, params, max_position, serving_len)
    raise UnsupportedCheckpointError(
        f"rope scaling type {kind!r} (config rope_scaling / rope_parameters) is not supported; "
        f"supported: {', '.join(ROPE_TYPES)}")


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times (1 when not stretched)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn(dim: int, base: float, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor") or max_position / original  # DeepSeek-V3 may give only the two lengths
    original = original or max_position // factor
    mscale = params.get("attention_factor")
    if mscale is None:  # DeepSeek's mscale / mscale_all_dim: the rest of the temperature goes into the softmax scale
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        mscale = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):  # gpt-oss keeps the fractional range
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(mscale)


def _longrope(dim: int, base: float, params: dict, max_position: int,
              serving_len: int | None) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-frequency divisors, `short_factor` within the original context, `long_factor` past it.

    transformers switches a sequence to the long factors when it outgrows the original context, and then
    recomputes its whole cache. A paged cache keeps its rotated keys, so one set serves every position:
    the long factors when sequences may outgrow the original context (serving length = max_model_len),
    as vLLM does. Both agree with transformers on prompts longer than the original context, and on
    sequences that stay within it under a max_model_len that does too.
    """
    original = params["original_max_position_embeddings"]
    which = "long_factor" if (serving_len or max_position) > original else "short_factor"
    factor = params.get("factor") or max_position / original
    mscale = params.get("attention_factor") or (
        math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0)
    divisors = torch.tensor(params[which], dtype=torch.float32, device="cpu")
    if divisors.numel() != dim // 2:
        raise UnsupportedCheckpointError(
            f"rope {which} has {divisors.numel()} entries; expected rotary_dim / 2 = {dim // 2}")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (divisors * base ** exponents), float(mscale)


class CosSin(NamedTuple):
    """cos/sin [T, rotary_dim] in the layout `apply_rotary(x, *cos_sin)` should rotate."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool = False


class RotaryEmbedding(nn.Module):
    """`max_position` is the checkpoint's context (max_position_embeddings); `serving_len` the engine's
    max_model_len, when it differs (LongRoPE picks its frequencies by it)."""

    def __init__(self, rotary_dim: int, params: dict, max_position: int, interleaved: bool = False,
                 serving_len: int | None = None) -> None:
        super().__init__()
        self._params, self._max_position = params, max_position
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        self.set_serving_len(serving_len)

    def set_serving_len(self, serving_len: int | None) -> None:
        """(Re)pick the frequencies for the engine's max_model_len (None: the checkpoint's context)."""
        # A plain attribute, not a buffer: it is computed, never loaded, and survives meta construction.
        self.inv_freq, self.attention_scaling = _inv_freq(self.rotary_dim, self._params, self._max_position,
                                                          serving_len)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> CosSin:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = freqs.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat((freqs, freqs), dim=-1)
        return CosSin((emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype),
                      self.interleaved)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                 norm: RMSNorm | None = None) -> torch.Tensor:
    """x: [T, heads, dim]; rotates the first cos.shape[-1] dims (partial rotary keeps the rest).

    Rotate-half pairs dim i with i + rot/2; interleaved pairs 2i with 2i + 1. norm: a per-head q/k norm
    applied first, in the same kernel pass where it takes both (bit-identical to norm, then rotary).
    """
    out = _rope_kernel(x, x.shape[1], cos, sin, interleaved, norm)
    if out is not None:
        return out
    if norm is not None:
        return apply_rotary(norm(x), cos, sin, interleaved)
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if interleaved:
        rotated = torch.stack((-x_rot[..., 1::2], x_rot[..., 0::2]), dim=-1).flatten(-2)
    else:
        half = rot // 2
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, x_pass), dim=-1) if x_pass.numel() else out


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos_sin: CosSin, q_norm: RMSNorm | None = None,
                    k_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary on q [T, heads, dim] and k [T, kv_heads, dim], each with its per-head norm: one kernel
    call (views of one [T, heads + kv_heads, dim] result) when k's heads follow q's in memory, as the views
    of a fused qkv projection do (at decode one call of ~10 us of dispatch fewer per layer); else two."""
    cos, sin, interleaved = cos_sin
    heads, dim = q.shape[1], q.shape[2]
    if (k.data_ptr() == q.data_ptr() + heads * dim * q.element_size() and k.dtype == q.dtype and k.shape[2] == dim
            and (k.stride(0) == q.stride(0) or q.shape[0] == 1)):
        both = _rope_kernel(q, heads + k.shape[1], cos, sin, interleaved, q_norm, k_norm)
        if both is not None:
            return both.split_with_sizes((heads, k.shape[1]), 1)  # one op for both views (slicing: two of ~1.4 us)
    return apply_rotary(q, cos, sin, interleaved, q_norm), apply_rotary(k, cos, sin, interleaved, k_norm)


def _rope_kernel(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                 norm: RMSNorm | None, k_norm: RMSNorm | None = None) -> torch.Tensor | None:
    """The C kernel's rotation (one call instead of six ops) of the first `heads` heads at x (more than
    x.shape[1]: k's heads after q's, normalized by k_norm) for float32 (bit-identical to the torch path) or
    bfloat16 (float32 products rounded once) CPU tensors whose heads are contiguous within a token (q/k views
    of the fused qkv output are), with the q/k norm first when it is an RMSNorm the kernels take; else None."""
    dtype = x.dtype
    if (dtype not in _KERNEL_DTYPES or cos.dtype != dtype or sin.dtype != dtype or not x.is_cpu or x.dim() != 3
            or x.stride(2) != 1 or x.stride(1) != x.shape[2]):
        return None
    q_scale = k_scale = None
    if norm is not None:  # both norms the kernels take, at one eps and one scale format
        q_scale = norm.kernel_operand(x) if isinstance(norm, RMSNorm) else None
        k_scale = q_scale if k_norm is None else k_norm.kernel_operand(x) if isinstance(k_norm, RMSNorm) else None
        if q_scale is None or k_scale is None or k_scale[1] != q_scale[1] or k_norm is not None and k_norm.eps != norm.eps:
            return None
    elif k_norm is not None:
        return None
    lib = layer_kernels()
    if lib is None:
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    tokens, dim = x.shape[0], x.shape[2]
    out = torch.empty(tokens, heads, dim, dtype=dtype)
    head_norm = (None, None, 0) if q_scale is None else (q_scale[0].data_ptr(), k_scale[0].data_ptr(), x.shape[1])
    rope = (norm.eps if norm is not None else 0.0, cos.data_ptr(), sin.data_ptr(), out.data_ptr(), tokens, heads,
            dim, cos.shape[-1], int(interleaved), torch.get_num_threads())
    if dtype == torch.float32:
        lib.vq_rope(x.data_ptr(), x.stride(0), *head_norm, *rope)
    else:
        lib.vq_rope_bf16(x.data_ptr(), x.stride(0), *head_norm, q_scale[1] if q_scale else 0, *rope)
    return out
