"""The C RMSNorm and rotary kernels against the torch expressions they replace."""
from __future__ import annotations

import pytest
import torch

import vllmpy.layers.norm as norm
import vllmpy.layers.rotary as rotary
from vllmpy.kernels import layer_kernels
from vllmpy.layers.norm import GemmaRMSNorm, RMSNorm
from vllmpy.layers.rotary import apply_rotary

pytestmark = pytest.mark.skipif(layer_kernels() is None, reason="no C compiler: the torch path is the only path")


def _reference_rms(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    return scale * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dim", [64, 256, 640, 2051])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm_kernel_matches_torch_to_float_rounding(dim: int, rows: int) -> None:
    torch.manual_seed(dim + rows)
    x = torch.randn(rows, dim) * torch.logspace(-3, 3, rows)[:, None]
    module = GemmaRMSNorm(dim, eps=1e-6)
    module.weight.data = torch.randn(dim)
    module.finish_loading()
    got = module(x)
    want = _reference_rms(x.double(), 1.0 + module.weight.double(), 1e-6)
    # The mean of squares is rounded once (the torch path rounds a float sum): a few ulp at most.
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=0)


def test_rms_norm_takes_the_kernel_and_falls_back_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    module = RMSNorm(32)
    module.weight.data = torch.randn(32)
    x = torch.randn(3, 32)
    calls = []
    real = layer_kernels()

    class Spy:
        def vq_rms_norm(self, *args):
            calls.append(args)
            return real.vq_rms_norm(*args)

    monkeypatch.setattr(norm, "layer_kernels", lambda: Spy())
    fast = module(x)
    assert len(calls) == 1
    monkeypatch.setattr(norm, "layer_kernels", lambda: None)
    assert torch.allclose(fast, module(x), rtol=1e-6, atol=1e-7)
    # bfloat16 keeps the reference's casts (normalize in fp32, cast, then scale): never the kernel
    monkeypatch.setattr(norm, "layer_kernels", lambda: Spy())
    module.weight.data = module.weight.data.bfloat16()
    assert module(x.bfloat16()).dtype == torch.bfloat16 and len(calls) == 1


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [128, 96])  # 96 of 128: partial rotary passes the rest through
def test_rope_kernel_is_bit_identical_on_views_of_fused_qkv(interleaved: bool, rot: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(rot)
    tokens, heads, dim = 7, 3, 128
    qkv = torch.randn(tokens, (heads + 2) * dim)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)  # a strided view, as Attention passes it
    angles = torch.arange(tokens).float()[:, None] * torch.rand(rot // 2)[None, :]
    emb = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    got = apply_rotary(q, emb.cos(), emb.sin(), interleaved)
    monkeypatch.setattr(rotary, "layer_kernels", lambda: None)
    want = apply_rotary(q, emb.cos(), emb.sin(), interleaved)
    assert torch.equal(got, want)
    assert not torch.equal(want, q)  # it did rotate
