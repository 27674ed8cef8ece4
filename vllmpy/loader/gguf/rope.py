"""HF `rope_scaling` from GGUF: the `{arch}.rope.scaling.*` keys, or llama.cpp's `rope_freqs` tensor.

llama.cpp writes Llama 3.1-style scaling not as keys but as one divisor per rotary frequency
(`rope_freqs.weight`); HF describes the same curve by four numbers. Only the two wavelength
thresholds matter, so `low_freq_factor` is fixed at 1 and the rest is fitted from the divisors on
the smooth part of the curve, then checked by recomputing every divisor.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.loader.gguf.metadata import ArchMetadata

# GGUF scaling key (after `rope.scaling.`) -> HF rope_scaling key, per scaling type.
_KEYS = {
    "linear": {"factor": "factor"},
    "yarn": {"factor": "factor", "original_context_length": "original_max_position_embeddings",
             "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"},
}
# Informational keys that change nothing at inference.
_IGNORED = {"finetuned"}


def rope_scaling(meta: ArchMetadata, head_dim: int, rope_theta: float,
                 rope_freqs: np.ndarray | None) -> dict[str, Any] | None:
    keys = meta.with_prefix("rope.scaling.")
    kind = keys.pop("type", "none")
    if rope_freqs is not None:
        if kind != "none":
            raise UnsupportedCheckpointError(
                f"GGUF has both a rope_freqs tensor and {meta.key('rope.scaling.type')}={kind!r}")
        return llama3_from_factors(rope_freqs, head_dim, rope_theta)
    if kind == "none":
        return None
    if kind not in _KEYS:
        raise UnsupportedCheckpointError(
            f"GGUF {meta.key('rope.scaling.type')}={kind!r} is not supported; supported: {', '.join(_KEYS)}")
    scaling: dict[str, Any] = {"rope_type": kind}
    for name, value in keys.items():
        if name in _IGNORED:
            continue
        if kind == "yarn" and name == "yarn_log_multiplier":  # DeepSeek's 0.1 * mscale_all_dim (= mscale)
            scaling["mscale"] = scaling["mscale_all_dim"] = value / 0.1
            continue
        if name not in _KEYS[kind]:
            raise UnsupportedCheckpointError(
                f"GGUF key {meta.key('rope.scaling.' + name)!r} is not supported with {kind} rope scaling")
        scaling[_KEYS[kind][name]] = value
    if "factor" not in scaling:
        raise UnsupportedCheckpointError(f"GGUF metadata key {meta.key('rope.scaling.factor')!r} is required "
                                         f"with {kind} rope scaling but missing")
    return scaling


def _llama3_divisors(inv_freq: np.ndarray, factor: float, original: float, high_freq_factor: float) -> np.ndarray:
    """The per-frequency divisor of Llama 3 scaling with low_freq_factor = 1 (HF's formula)."""
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - 1.0) / (high_freq_factor - 1.0)
    medium = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < original / high_freq_factor, 1.0, np.where(wavelen > original, factor, medium))


def llama3_from_factors(factors: np.ndarray, head_dim: int, rope_theta: float) -> dict[str, Any]:
    """Recover HF llama3 rope_scaling from llama.cpp's per-frequency divisors, or refuse if they are not that."""
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.size != head_dim // 2:
        raise UnsupportedCheckpointError(
            f"rope_freqs.weight has {factors.size} entries; expected head_dim / 2 = {head_dim // 2}")
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(factors.max())
    medium = (factors > 1.0 + 1e-6) & (factors < factor * (1.0 - 1e-6))
    if medium.sum() < 2:
        raise UnsupportedCheckpointError(
            "rope_freqs.weight does not determine Llama 3 rope scaling (fewer than two smoothly scaled "
            "frequencies); this GGUF's rope scaling is not supported")
    # On the smooth part, s = (original / wavelen - 1) / (high - 1): linear in (original, high - 1).
    smooth = (1.0 / factors[medium] - 1.0 / factor) / (1.0 - 1.0 / factor)
    wavelen = 2 * math.pi / inv_freq[medium]
    system = np.stack([1.0 / wavelen, -smooth], axis=1)
    (original, high_minus_one), *_ = np.linalg.lstsq(system, np.ones_like(smooth), rcond=None)
    original, high = round(float(original)), round(float(high_minus_one) + 1.0, 4)
    if original <= 0 or high <= 1.0:
        raise _not_llama3()
    if not np.allclose(_llama3_divisors(inv_freq, factor, original, high), factors, rtol=1e-4, atol=0.0):
        raise _not_llama3()
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
            "original_max_position_embeddings": original}


def _not_llama3() -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(
        "rope_freqs.weight does not follow Llama 3 rope scaling; this GGUF's rope scaling is not supported")
