"""The C RMSNorm, rotary, gated-activation and row-max kernels against the torch expressions they replace."""
from __future__ import annotations

import pytest
import torch

import vllmpy.layers.activation as activation
import vllmpy.layers.norm as norm
import vllmpy.layers.rotary as rotary
import vllmpy.sampling.sampler as sampler
from torch.nn import functional as F

from vllmpy.kernels import layer_kernels
from vllmpy.layers.activation import gated
from vllmpy.layers.norm import GemmaRMSNorm, RMSNorm
from vllmpy.layers.rotary import apply_rotary

pytestmark = pytest.mark.skipif(layer_kernels() is None, reason="no C compiler: the torch path is the only path")


def spy_kernel(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list:
    """Calls of layer_kernels().<name> made through `module` (the real kernel still runs)."""
    real, calls = layer_kernels(), []

    class Spy:
        def __getattr__(self, attr: str):
            kernel = getattr(real, attr)
            return (lambda *args: calls.append(args) or kernel(*args)) if attr == name else kernel

    monkeypatch.setattr(module, "layer_kernels", lambda: Spy())
    return calls


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
    calls = spy_kernel(monkeypatch, norm, "vq_rms_norm")
    fast = module(x)
    assert len(calls) == 1
    monkeypatch.setattr(norm, "layer_kernels", lambda: None)
    assert torch.allclose(fast, module(x), rtol=1e-6, atol=1e-7)
    # float16 keeps the torch path (bfloat16 has its own kernel: tests/unit/test_layer_ops_bf16.py)
    calls = spy_kernel(monkeypatch, norm, "vq_rms_norm")
    module.weight.data = module.weight.data.half()
    assert module(x.half()).dtype == torch.float16 and len(calls) == 0


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


def _gemma_norm(dim: int) -> GemmaRMSNorm:
    module = GemmaRMSNorm(dim, eps=1e-6)
    module.weight.data = torch.randn(dim)
    module.finish_loading()
    return module


@pytest.mark.parametrize("rows", [1, 150])  # 150 x 640 takes the threaded loop
def test_add_norm_is_one_kernel_call_bit_identical_to_the_modules(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(rows)
    x, branch = torch.randn(rows, 640) * 30, torch.randn(rows, 640)
    post, pre = _gemma_norm(640), RMSNorm(640, eps=1e-6)
    pre.weight.data = torch.randn(640)
    want_x = x + post(branch)
    want_y = pre(want_x)
    calls = spy_kernel(monkeypatch, norm, "vq_add_rms_norm")
    got_x, got_y = norm.add_norm(x, branch, post, pre)
    only_x, none = norm.add_norm(x, branch, post)
    assert len(calls) == 2
    assert torch.equal(got_x, want_x) and torch.equal(got_y, want_y) and torch.equal(only_x, want_x) and none is None
    other_eps = RMSNorm(640, eps=1e-5)  # two eps: the modules, one after the other
    other_eps.weight.data = pre.weight.data
    assert torch.equal(norm.add_norm(x, branch, post, other_eps)[1], other_eps(want_x)) and len(calls) == 2


@pytest.mark.parametrize("rows", [1, 150])
def test_pre_norm_residual_add_is_one_kernel_call_bit_identical_to_torch(rows: int,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A pre-norm layer's step (branch_norm None): x + branch, then the next norm; or the add alone."""
    torch.manual_seed(rows)
    x, branch = torch.randn(rows, 640) * 30, torch.randn(rows, 640)
    pre = RMSNorm(640, eps=1e-5)
    pre.weight.data = torch.randn(640)
    calls = spy_kernel(monkeypatch, norm, "vq_add_rms_norm")
    got_x, got_y = norm.add_norm(x, branch, None, pre)
    only_x, none = norm.add_norm(x, branch, None)
    assert len(calls) == 2
    assert torch.equal(got_x, x + branch) and torch.equal(got_y, pre(x + branch))
    assert torch.equal(only_x, x + branch) and none is None
    assert torch.equal(norm.add_norm(x.double(), branch.double(), None)[0], x.double() + branch.double())  # torch
    assert len(calls) == 2


@pytest.mark.parametrize("tokens", [1, 7])
def test_rope_kernel_with_the_head_norm_equals_norm_then_rope(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(tokens)
    heads, dim = 4, 256
    qkv = torch.randn(tokens, (heads + 2) * dim) * 5
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    angles = torch.arange(tokens).float()[:, None] * torch.rand(dim // 2)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    q_norm = _gemma_norm(dim)
    want = apply_rotary(q_norm(q), emb.cos(), emb.sin())
    norms, ropes = spy_kernel(monkeypatch, norm, "vq_rms_norm"), spy_kernel(monkeypatch, rotary, "vq_rope")
    got = apply_rotary(q, emb.cos(), emb.sin(), norm=q_norm)
    assert torch.equal(got, want) and len(ropes) == 1 and not norms
    monkeypatch.setattr(rotary, "layer_kernels", lambda: None)
    assert torch.equal(apply_rotary(q, emb.cos(), emb.sin(), norm=q_norm), want)  # the torch rotation


@pytest.mark.parametrize("n", [1, 15, 16, 63, 64, 65, 1000, 262144])
def test_row_max_kernel_equals_torch_max_on_ties_and_non_finite(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(n)
    x = torch.randint(-3, 3, (12, n)).float()  # small integers: many ties, the first index must win
    x[1] = float("-inf")  # no finite logit: index 0, as torch
    x[2, -1] = float("inf")
    x[3, n // 2] = float("nan")  # NaN anywhere: max NaN, index of the first NaN
    x[3, n - 1] = float("nan")
    x[4] = -0.0
    x[4, n // 3] = 0.0  # equal to -0.0: the first index wins
    x[5, n - 1] = 1e30
    x[6] = torch.randn(n) * 1e-38  # subnormals
    calls = spy_kernel(monkeypatch, sampler, "vq_row_max")
    best, index = sampler._row_max(x)
    want_best, want_index = x.max(dim=-1)
    assert len(calls) == 1
    assert torch.equal(index, want_index) and torch.equal(index, x.argmax(dim=-1))
    assert torch.equal(best.isnan(), want_best.isnan())
    assert torch.equal(best.nan_to_num(), want_best.nan_to_num())
    assert torch.equal(best[~best.isnan()], x.amax(dim=-1)[~best.isnan()])


def _gelu_tanh_stable(g: torch.Tensor) -> torch.Tensor:
    """0.5 g (1 + tanh u) as g * sigmoid(2u): float64 without the cancellation of the tanh form at g < 0."""
    return g / (1 + torch.exp(-2 * _gelu_arg(g)))


def _gelu_arg(g: torch.Tensor) -> torch.Tensor:
    return (2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3)


@pytest.mark.parametrize("name", ["silu", "gelu_pytorch_tanh"])
def test_gated_activation_kernel_is_float_accurate(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    act = activation.get_activation(name)
    torch.manual_seed(len(name))
    gate_up = torch.randn(300, 2 * 2051) * torch.logspace(-4, 1.5, 300)[:, None]  # |gate| up to ~100
    calls = spy_kernel(monkeypatch, activation, "vq_gated_act")
    got = gated(act, gate_up).double()
    assert len(calls) == 1 and got.shape == (300, 2051)
    g, up = gate_up.double().chunk(2, dim=-1)
    if name == "silu":
        want, exponent = g / (1 + torch.exp(-g)) * up, g
    else:
        want, exponent = _gelu_tanh_stable(g) * up, 2 * _gelu_arg(g)
    # Float rounding of the exponent's argument grows with it: a few ulp times (1 + |argument|).
    bound = 4e-7 * (1 + exponent.abs()) * want.abs() + 1e-35
    assert bool(((got - want).abs() <= bound).all())
    # Where torch's float result is itself accurate (not the tanh form's cancelling tail) they agree.
    torch_result = (act(gate_up[:, :2051]) * gate_up[:, 2051:]).double()
    moderate = g.abs() < 2
    assert torch.allclose(got[moderate], torch_result[moderate], rtol=4e-6, atol=1e-30)


def test_gated_activation_kernel_special_values_and_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = torch.tensor([float("nan"), float("inf"), float("-inf"), -100.0, 100.0, 0.0, -0.0, 1e-30, 5.0])
    gate_up = torch.cat([gate, torch.ones(9)])[None]
    for act in (F.silu, activation.get_activation("gelu_new")):
        got, want = gated(act, gate_up), act(gate) * 1.0
        assert torch.equal(got.isnan(), want[None].isnan())
        assert torch.allclose(got.nan_to_num(), want[None].nan_to_num(), rtol=2e-6, atol=0)  # inf stays inf
        assert torch.equal(got.signbit(), want[None].signbit())
    monkeypatch.setattr(activation, "layer_kernels", lambda: pytest.fail("kernel used"))
    x = torch.randn(3, 8)  # float16 and ReLU keep the torch path
    assert torch.equal(gated(F.silu, x.half()), F.silu(x[:, :4].half()) * x[:, 4:].half())
    assert torch.equal(gated(F.relu, x), F.relu(x[:, :4]) * x[:, 4:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_q_and_k_rotate_in_one_call_as_in_two(tokens: int, dtype: torch.dtype,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """apply_rotary_qk on adjacent q / k views of a fused qkv output: one kernel call, each with its own norm,
    bit-identical to apply_rotary on each; k not after q in memory: two calls."""
    torch.manual_seed(tokens)
    heads, kv_heads, dim = 4, 2, 128
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, dim) * 3).to(dtype)
    q, k, _ = qkv.split_with_sizes((heads, kv_heads, kv_heads), 1)
    angles = torch.arange(tokens).float()[:, None] * torch.rand(dim // 2)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q_norm, k_norm = _gemma_norm(dim), _gemma_norm(dim)
    want = (apply_rotary(q, cos, sin, norm=q_norm), apply_rotary(k, cos, sin, norm=k_norm))
    name = "vq_rope" if dtype == torch.float32 else "vq_rope_bf16"
    ropes = spy_kernel(monkeypatch, rotary, name)
    got = rotary.apply_rotary_qk(q, k, rotary.CosSin(cos, sin), q_norm, k_norm)
    assert len(ropes) == 1 and all(torch.equal(g, w) for g, w in zip(got, want))
    apart = rotary.apply_rotary_qk(q, k.clone(), rotary.CosSin(cos, sin), q_norm, k_norm)
    assert len(ropes) == 3 and all(torch.equal(g, w) for g, w in zip(apart, want))
    assert all(torch.equal(g, w) for g, w in zip(rotary.apply_rotary_qk(q, k, rotary.CosSin(cos, sin)), (
        apply_rotary(q, cos, sin), apply_rotary(k, cos, sin))))
