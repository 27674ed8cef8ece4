"""The bfloat16 layer-op kernels against torch's bf16 ops (each computed in float32 and rounded to nearest
even), in the native build and the portable one (no -march=native)."""
from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import vllmpy.kernels as kernels
import vllmpy.layers.activation as activation
import vllmpy.layers.norm as norm
import vllmpy.layers.rotary as rotary
from vllmpy.layers.activation import gated
from vllmpy.layers.norm import GemmaRMSNorm, RMSNorm
from vllmpy.layers.rotary import apply_rotary

pytestmark = pytest.mark.skipif(kernels.layer_kernels() is None, reason="no C compiler: the torch path only")

BF16 = torch.bfloat16


@pytest.fixture(params=["native", "portable"])
def lib(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    """The layer-op library of one build, patched into the modules that call it."""
    flags = kernels._FLAGS + (kernels._NATIVE if request.param == "native" else [])
    source = Path(kernels.__file__).with_name("layer_ops.c")
    built = kernels._bind_layer_ops(ctypes.CDLL(str(kernels._build(source, flag_sets=(flags,)))))
    for module in (norm, rotary, activation):
        monkeypatch.setattr(module, "layer_kernels", lambda: built)
    return built


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps (finite values of one sign: bit patterns are ordered)."""
    assert got.dtype == want.dtype == BF16
    return (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _gemma(dim: int) -> GemmaRMSNorm:
    module = GemmaRMSNorm(dim, eps=1e-6)
    module.weight.data = torch.randn(dim)
    module.finish_loading()
    return module


def _llama(dim: int) -> RMSNorm:
    module = RMSNorm(dim, eps=1e-6)
    module.weight.data = torch.randn(dim).to(BF16)
    return module


@pytest.mark.parametrize("rows", [1, 150])  # 150 x 640 takes the threaded loop
def test_rms_norm_bf16_within_one_ulp_of_float32_rounded(lib: ctypes.CDLL, rows: int) -> None:
    torch.manual_seed(rows)
    x = (torch.randn(rows, 640) * torch.logspace(-3, 3, rows)[:, None]).to(BF16)
    gemma, llama = _gemma(640), _llama(640)
    want_gemma = (_normalized(x, 1e-6) * gemma.scale).to(BF16)
    want_llama = (llama.weight.float() * _normalized(x, 1e-6).to(BF16).float()).to(BF16)
    for module, want in ((gemma, want_gemma), (llama, want_llama)):
        got = module(x)
        assert got.dtype == BF16
        # the mean of squares is rounded once (torch rounds a float sum): a bf16 step where that flips a tie
        assert int(ulps(got, want).max()) <= 1 and float((got == want).float().mean()) > 0.99


@pytest.mark.parametrize("make_norm", [_gemma, _llama])
def test_add_norm_bf16_is_bit_identical_to_the_modules(lib: ctypes.CDLL, make_norm) -> None:
    torch.manual_seed(3)
    x, branch = (torch.randn(5, 640) * 30).to(BF16), torch.randn(5, 640).to(BF16)
    post, pre = make_norm(640), make_norm(640)
    got_x, got_y = norm.add_norm(x, branch, post, pre)
    want_x = x + post(branch)
    assert torch.equal(got_x, want_x) and torch.equal(got_y, pre(want_x))
    reference = (x.float() + (_normalized(branch, 1e-6) * post.scale).to(BF16).float()).to(BF16) \
        if isinstance(post, GemmaRMSNorm) else None
    if reference is not None:
        assert int(ulps(got_x, reference).max()) <= 1


def test_pre_norm_residual_add_bf16_is_bit_identical_to_torch(lib: ctypes.CDLL) -> None:
    torch.manual_seed(4)
    x, branch = (torch.randn(5, 640) * 30).to(BF16), torch.randn(5, 640).to(BF16)
    pre = _llama(640)
    got_x, got_y = norm.add_norm(x, branch, None, pre)
    assert torch.equal(got_x, x + branch) and torch.equal(got_y, pre(x + branch))
    assert torch.equal(norm.add_norm(x, branch, None)[0], x + branch)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [256, 192])  # 192 of 256: partial rotary passes the rest through
def test_rope_bf16_is_bit_identical_to_torchs_bf16_ops(lib: ctypes.CDLL, interleaved: bool, rot: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(rot)
    tokens, heads, dim = 7, 3, 256
    qkv = (torch.randn(tokens, (heads + 2) * dim) * 4).to(BF16)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)  # a strided view, as Attention passes it
    angles = torch.arange(tokens).float()[:, None] * torch.rand(rot // 2)[None, :]
    emb = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(BF16), emb.sin().to(BF16)
    got = apply_rotary(q, cos, sin, interleaved)
    head_norms = (_gemma(dim), _llama(dim))
    fused = [apply_rotary(q, cos, sin, interleaved, norm=head_norm) for head_norm in head_norms]
    normed = [head_norm(q) for head_norm in head_norms]  # the norm kernel: q/k norm, then rotary
    monkeypatch.setattr(rotary, "layer_kernels", lambda: None)
    assert got.dtype == BF16 and torch.equal(got, apply_rotary(q, cos, sin, interleaved))
    for one, head in zip(fused, normed):
        assert torch.equal(one, apply_rotary(head, cos, sin, interleaved))


@pytest.mark.parametrize("name", ["silu", "gelu_pytorch_tanh"])
def test_gated_act_bf16_within_one_ulp_of_torchs_bf16_ops(lib: ctypes.CDLL, name: str) -> None:
    act = activation.get_activation(name)
    torch.manual_seed(len(name))
    gate_up = (torch.randn(40, 2 * 2051) * torch.logspace(-3, 1, 40)[:, None]).to(BF16)
    got = gated(act, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    g64 = gate.double()
    inner = (2 / torch.pi) ** 0.5 * (g64 + 0.044715 * g64 ** 3)
    # torch's tanh form cancels for gates below -2 (0 where the value is ~1e-19): there the float64 value,
    # 0.5 g (1 + tanh u) written g / (1 + e^(-2u)), rounded to bf16, is the activation
    activated = act(gate)
    if name != "silu":
        activated = torch.where(gate < -2, (g64 / (1 + torch.exp(-2 * inner))).to(BF16), activated)
    want = activated * up  # the kernel's e^x differs from torch's in the last float bits
    assert got.dtype == BF16 and got.shape == (40, 2051)
    # where the kernel's e^x overflows (argument > 88.72) the activation is 0 (torch's: up to ~1e-37)
    flushed = ((-g64 if name == "silu" else -2 * inner) > 88.72) & (got == 0)
    same_sign = (got.signbit() == want.signbit()) | (want == 0) | flushed
    assert bool(same_sign.all()) and int(ulps(got, want)[~flushed].max()) <= 1


def test_bf16_special_values_and_float16_keeps_torch(lib: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = torch.tensor([float("nan"), float("inf"), float("-inf"), -100.0, 100.0, 0.0, 1e-30, 5.0])
    gate_up = torch.cat([gate, torch.ones(8)])[None].to(BF16)
    got, want = gated(F.silu, gate_up), (F.silu(gate) * 1.0)[None].to(BF16)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    for module in (norm, activation):
        monkeypatch.setattr(module, "layer_kernels", lambda: pytest.fail("kernel used"))
    x = torch.randn(3, 8).half()
    assert gated(F.silu, x).dtype == torch.float16 and _llama(8).half()(x).dtype == torch.float16
