"""dense_linear: oneDNN for large float products on x86 CPUs, F.linear otherwise, same results."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from vllmpy.layers import dense
from vllmpy.layers.dense import dense_linear

pytestmark = pytest.mark.skipif(dense.onednn_linear is None, reason="no oneDNN on this build/CPU: F.linear only")


@pytest.mark.parametrize("shape", [(300, 640), (2, 150, 640), (1, 640)])
@pytest.mark.parametrize("bias", [False, True])
def test_large_products_take_onednn_and_match_f_linear(shape: tuple[int, ...], bias: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(*shape), torch.randn(4096, 640)
    b = torch.randn(4096) if bias else None
    calls = []
    real = dense.onednn_linear
    monkeypatch.setattr(dense, "onednn_linear", lambda *args: calls.append(args) or real(*args))
    got = dense_linear(x, w, b)
    assert len(calls) == 1 and got.shape == (*shape[:-1], 4096)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = F.linear(x.double().abs(), w.double().abs()) + 1
    assert ((got.double() - want).abs() / scale).max() < 1e-6


def test_small_products_and_other_dtypes_keep_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dense, "onednn_linear", lambda *args: pytest.fail("oneDNN for a small product"))
    x, w = torch.randn(3, 64), torch.randn(128, 64)
    assert torch.equal(dense_linear(x, w), F.linear(x, w))
    x, w = torch.randn(300, 640, dtype=torch.float64), torch.randn(4096, 640, dtype=torch.float64)
    assert torch.equal(dense_linear(x, w), F.linear(x, w))
