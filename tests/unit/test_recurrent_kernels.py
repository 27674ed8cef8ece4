"""The recurrent decode kernels (vllmpy/kernels/recurrent_ops.c) against the layers' torch decode paths.

Each layer (Mamba2 mixer, Gated DeltaNet, LFM2's short conv) runs the same decode-only steps twice from the
same seats: once through the kernels, once with them switched off (the torch ops other devices and
compiler-less hosts take); outputs and every seat agree within 1e-5 in float32, with n_groups > 1, more
value than key heads, and seats out of order (seats no row owns are left as they were). bf16 SSM states
(--mamba-ssm-cache-dtype bfloat16) agree to the state's rounding; the AVX2 and portable builds agree with
this CPU's."""
from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from vllmpy import kernels
from vllmpy.layers import recurrent_kernels
from vllmpy.layers.gated_delta_net import GatedDeltaNet
from vllmpy.layers.mamba2 import Mamba2Mixer
from vllmpy.layers.recurrent_state import RecurrentMetadata
from vllmpy.layers.short_conv import ShortConv

SEATS = [5, 0, 3]  # out of order, with seats 1, 2, 4 and 6 owned by nobody
NUM_SEATS = 7
BUILDS = {"avx2": ["-march=native", "-mno-avx512f"], "scalar": []}  # besides this CPU's own (-march=native)


def _randomized(module: torch.nn.Module, seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * 0.3).to(dtype)
    return module.to(dtype)


def mamba2(groups: int, dtype: torch.dtype = torch.float32) -> Mamba2Mixer:
    return _randomized(Mamba2Mixer(48, num_heads=4, head_dim=8, n_groups=groups, state_size=40, conv_kernel=4,
                                   chunk_size=8, eps=1e-5), seed=groups, dtype=dtype)


def gdn(repeat: int) -> GatedDeltaNet:
    config = dict(linear_num_key_heads=2, linear_num_value_heads=2 * repeat, linear_key_head_dim=24,
                  linear_value_head_dim=20, linear_conv_kernel_dim=4, hidden_size=48)
    return _randomized(GatedDeltaNet(config, eps=1e-6), seed=repeat)


def short_conv(dtype: torch.dtype = torch.float32) -> ShortConv:
    return _randomized(ShortConv(48, kernel=3, bias=True), seed=7, dtype=dtype)


def _states(layer: torch.nn.Module, ssm_dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    spec = layer.recurrent_state_spec(ssm_dtype)
    return [torch.randn(NUM_SEATS, *shape, generator=gen).to(dtype) for shape, dtype in zip(spec.shapes, spec.dtypes)]


def _decode(layer: torch.nn.Module, states: list[torch.Tensor], steps: int, dtype: torch.dtype,
            use_kernels: bool, monkeypatch) -> list[torch.Tensor]:
    """The layer's outputs over `steps` decode-only steps of the SEATS rows (states updated in place)."""
    with monkeypatch.context() as m:
        if not use_kernels:  # as on a host without a C compiler
            m.setattr(recurrent_kernels, "recurrent_kernels", lambda: None)
        meta = RecurrentMetadata.build(SEATS, [9] * len(SEATS), [1] * len(SEATS), torch.device("cpu"))
        gen = torch.Generator().manual_seed(3)
        return [layer(torch.randn(len(SEATS), 48, generator=gen).to(dtype), states, meta) for _ in range(steps)]


def _compare(layer: torch.nn.Module, monkeypatch, ssm_dtype: torch.dtype = torch.float32,
             dtype: torch.dtype = torch.float32, tol: float = 1e-5, steps: int = 3, scaled: bool = False) -> None:
    """scaled: tol is relative to each tensor's largest value (bf16 models, whose rounding points differ)."""
    with torch.no_grad():
        ref_states, states = _states(layer, ssm_dtype), _states(layer, ssm_dtype)
        ref = _decode(layer, ref_states, steps, dtype, False, monkeypatch)
        calls = []
        lib = kernels.recurrent_kernels()
        assert lib is not None, "the recurrent kernels did not build on this host"
        monkeypatch.setattr(recurrent_kernels, "recurrent_kernels", lambda: calls.append(1) or lib)
        out = _decode(layer, states, steps, dtype, True, monkeypatch)
    assert calls, "the decode step did not take the kernels"
    for got, want in zip(out + states, ref + ref_states):
        atol = tol * want.float().abs().max().item() if scaled else tol
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0 if scaled else tol)
    for got, want in zip(states, ref_states):
        if got.dtype == torch.bfloat16 and not scaled:  # rounded to nearest even as torch's .to: ties are rare
            assert (got != want).float().mean() < 0.01
    fresh = _states(layer, ssm_dtype)
    idle = [s for s in range(NUM_SEATS) if s not in SEATS]
    for got, before in zip(states, fresh):
        assert torch.equal(got[idle], before[idle])
        assert not torch.equal(got[SEATS], before[SEATS])


@pytest.mark.parametrize("groups", [1, 2])
def test_mamba2_decode_kernels_equal_the_torch_step(groups, monkeypatch):
    _compare(mamba2(groups), monkeypatch)


@pytest.mark.parametrize("repeat", [1, 2])
def test_gated_delta_decode_kernels_equal_the_torch_step(repeat, monkeypatch):
    _compare(gdn(repeat), monkeypatch)


def test_short_conv_decode_kernel_equals_the_torch_step(monkeypatch):
    _compare(short_conv(), monkeypatch)


@pytest.mark.parametrize("make", [lambda: mamba2(2), lambda: gdn(2)], ids=["mamba2", "gdn"])
def test_bf16_ssm_states_agree_to_their_rounding(make, monkeypatch):
    # both paths round the same float32 state once per step; a rare tie broken differently is one bf16 ulp
    _compare(make(), monkeypatch, ssm_dtype=torch.bfloat16, tol=1e-2, steps=2)


@pytest.mark.parametrize("make", [lambda: mamba2(2, torch.bfloat16), lambda: short_conv(torch.bfloat16)],
                         ids=["mamba2", "short_conv"])
def test_a_bf16_model_agrees_to_bf16_precision(make, monkeypatch):
    # the kernels keep the conv output in float32 where the torch path rounds it to bf16 first
    _compare(make(), monkeypatch, dtype=torch.bfloat16, tol=2 ** -6, steps=2, scaled=True)


def test_float16_states_and_other_devices_keep_the_torch_ops():
    cpu = torch.zeros(2, 3, 4)
    assert recurrent_kernels.decode_kernels(cpu) is not None
    assert recurrent_kernels.decode_kernels(cpu, cpu.half()) is None
    assert recurrent_kernels.decode_kernels(cpu.to("meta")) is None
    assert recurrent_kernels.decode_kernels(cpu.transpose(1, 2)) is None  # seats must be contiguous


def _build(name: str, flags: list[str], out) -> ctypes.CDLL:
    target = out / f"recurrent_ops-{name}.so"
    kernels._compile("cc", kernels._FLAGS + flags, kernels.Path(kernels.__file__).with_name("recurrent_ops.c"),
                     target)
    return kernels._bind_recurrent(ctypes.CDLL(str(target)))


@pytest.mark.parametrize("build", list(BUILDS))
def test_the_avx2_and_portable_builds_agree_with_the_native_one(build, tmp_path, monkeypatch):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.fail("these builds name x86 flags")
    lib = _build(build, BUILDS[build], tmp_path)
    native_states = _states(layer := mamba2(2), torch.float32)
    states = _states(layer, torch.float32)
    with torch.no_grad():
        want = _decode(layer, native_states, 2, torch.float32, True, monkeypatch)
        monkeypatch.setattr(recurrent_kernels, "recurrent_kernels", lambda: lib)
        got = _decode(layer, states, 2, torch.float32, True, monkeypatch)
        for layer_other in (gdn(2), short_conv()):
            native = _states(layer_other, torch.bfloat16)
            other = _states(layer_other, torch.bfloat16)
            monkeypatch.setattr(recurrent_kernels, "recurrent_kernels", kernels.recurrent_kernels)
            want += _decode(layer_other, native, 2, torch.float32, True, monkeypatch) + native
            monkeypatch.setattr(recurrent_kernels, "recurrent_kernels", lambda: lib)
            got += _decode(layer_other, other, 2, torch.float32, True, monkeypatch) + other
    for g, w in zip(got + states, want + native_states):
        torch.testing.assert_close(g.float(), w.float(), atol=1e-5, rtol=1e-5)
