"""The SSD chunked scan equals the step-by-step Mamba2 recurrence, wherever the chunk boundaries and the
prefill splits fall."""
from __future__ import annotations

import pytest
import torch

from vllmpy.layers.mamba2 import ssd_chunk_scan, ssd_step

HEADS, HEAD_DIM, GROUPS, STATE = 4, 3, 2, 5
TOL = 1e-5  # relative to the largest output (float32 rounding of both sides grows with it)


def close(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    return float((ours - ref).abs().max()) < TOL * max(1.0, float(ref.abs().max()))


def inputs(length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(length, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    dt = torch.nn.functional.softplus(torch.randn(length, HEADS, generator=g, dtype=torch.float64))
    a = -torch.rand(HEADS, generator=g, dtype=torch.float64) * 2
    b, c = (torch.randn(length, GROUPS, STATE, generator=g, dtype=torch.float64) for _ in range(2))
    state = torch.randn(HEADS, HEAD_DIM, STATE, generator=g, dtype=torch.float64)
    return x.float(), dt.float(), a.float(), b.float(), c.float(), state.float()


def stepwise(x, dt, a, b, c, state):
    ys, s = [], state[None]
    for t in range(x.shape[0]):
        y, s = ssd_step(x[t:t + 1], dt[t:t + 1], a, b[t:t + 1], c[t:t + 1], s)
        ys.append(y[0])
    return torch.stack(ys), s[0]


@pytest.mark.parametrize("chunk", [1, 3, 4, 16])
def test_chunk_scan_matches_recurrence_for_every_length(chunk: int) -> None:
    for length in range(1, 19):  # every remainder modulo the chunk, and more than one chunk
        x, dt, a, b, c, state = inputs(length, seed=length)
        y_ref, s_ref = stepwise(x, dt, a, b, c, state)
        y, s = ssd_chunk_scan(x, dt, a, b, c, state, chunk)
        assert close(y, y_ref), (chunk, length)
        assert close(s, s_ref), (chunk, length)


@pytest.mark.parametrize("chunk", [3, 4])
def test_split_prefill_continues_the_state(chunk: int) -> None:
    """A prompt computed in two calls (chunked prefill across steps) at every split point."""
    length = 13
    x, dt, a, b, c, state = inputs(length, seed=99)
    y_ref, s_ref = stepwise(x, dt, a, b, c, state)
    for split in range(1, length):
        y1, s1 = ssd_chunk_scan(x[:split], dt[:split], a, b[:split], c[:split], state, chunk)
        y2, s2 = ssd_chunk_scan(x[split:], dt[split:], a, b[split:], c[split:], s1, chunk)
        assert close(torch.cat([y1, y2]), y_ref), split
        assert close(s2, s_ref), split


def test_strong_decay_stays_finite() -> None:
    """Large dt * |A| over a long chunk: decays that underflow to 0 must not turn into inf - inf or nan."""
    x, dt, a, b, c, state = inputs(64, seed=5)
    y_ref, s_ref = stepwise(x, dt * 20, a, b, c, state)
    y, s = ssd_chunk_scan(x, dt * 20, a, b, c, state, 64)
    assert torch.isfinite(y).all() and (y - y_ref).abs().max() < 1e-4 * max(1.0, float(y_ref.abs().max()))
