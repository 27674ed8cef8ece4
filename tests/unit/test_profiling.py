"""VLLMPY_PROFILE=1: the per-step breakdown names every phase, its phases add up to the step wall time,
C calls are timed under the phase that makes them, and with the switch off nothing is wrapped."""
from __future__ import annotations

import ctypes
import io
import re
import time
from types import SimpleNamespace

import pytest

from vllmpy import kernels, profiling
from vllmpy.profiling import PHASES, StepProfile


def _ms(report: str, label: str) -> float:
    match = re.search(rf"^\s*{re.escape(label)}\s+(-?[\d.]+) ms", report, re.M)
    assert match, f"{label!r} missing from:\n{report}"
    return float(match.group(1))


class _FakeCore:
    """The methods attach() wraps, each sleeping a known time; step() calls them as EngineCore does."""

    def __init__(self, lib: SimpleNamespace, steps: int) -> None:
        self.left = steps
        chunk = SimpleNamespace(token_ids=[1, 2])
        self.scheduler = SimpleNamespace(
            schedule=lambda: time.sleep(0.002) or SimpleNamespace(is_empty=False, chunks=[chunk]),
            update_from_output=lambda so, out: time.sleep(0.001))
        model = SimpleNamespace(forward=lambda: time.sleep(0.002) or lib.vq_matmul(0.003),
                                compute_logits=lambda: lib.vq_matmul(0.001))
        self.runner = SimpleNamespace(model=model, _update_states=lambda so: time.sleep(0.0005),
                                      _prepare=lambda so: time.sleep(0.001), _sample=lambda: time.sleep(0.001))

    def step(self):
        so = self.scheduler.schedule()
        self.runner._update_states(so)
        self.runner._prepare(so)
        self.runner.model.forward()
        self.runner.model.compute_logits()
        self.runner._sample()
        self.scheduler.update_from_output(so, None)
        self.left -= 1
        return [], None, so

    def has_unfinished_requests(self) -> bool:
        return self.left > 0


def test_phases_add_up_to_the_step_wall_time():
    stream = io.StringIO()
    prof = StepProfile(every=3, stream=stream)
    lib = SimpleNamespace(vq_matmul=time.sleep)
    profiling.time_c_calls(lib, "packed matmul", ("vq_matmul",), prof)
    core = _FakeCore(lib, steps=6)
    profiling.attach(core, prof)
    start = time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
        if core.has_unfinished_requests():
            time.sleep(0.002)  # the caller's output processing
    wall_ms = (time.perf_counter() - start) * 1e3 / 6
    windows = stream.getvalue().split("vllmpy profile")[1:]
    assert len(windows) == 2 and all("last 3 steps" in w for w in windows)  # printed every 3 steps
    prof.print_total()
    report = stream.getvalue().split("vllmpy profile")[-1]
    assert "all 6 steps" in report and "2.0 tokens/step" in report
    step_ms = float(re.search(r"([\d.]+) ms/step wall", report).group(1))
    phases = {phase: _ms(report, profiling._LABELS.get(phase, phase)) for phase in PHASES}
    assert sum(phases.values()) + _ms(report, "unattributed") == pytest.approx(step_ms, abs=0.01)
    assert _ms(report, "unattributed") < 0.1 * step_ms  # the wrapped phases cover the step
    assert step_ms == pytest.approx(wall_ms, rel=0.1)
    assert phases["forward"] >= 5.0 and phases["logits"] >= 1.0 and phases["outside"] >= 2.0 * 5 / 6
    # C time is charged to the phase that called it; the rest of the phase is torch / Python
    kernel_lines = re.findall(r"^\s+packed matmul kernels\s+([\d.]+) ms", report, re.M)
    assert len(kernel_lines) == 2 and float(kernel_lines[0]) >= 3.0 and float(kernel_lines[1]) >= 1.0
    rest = re.findall(r"^\s+rest \(torch ops, Python dispatch\)\s+([\d.]+) ms", report, re.M)
    assert float(kernel_lines[0]) + float(rest[0]) == pytest.approx(phases["forward"], abs=0.01)


def test_off_by_default_nothing_is_wrapped(monkeypatch):
    monkeypatch.delenv("VLLMPY_PROFILE", raising=False)
    assert not profiling.enabled()
    monkeypatch.setenv("VLLMPY_PROFILE", "0")
    assert not profiling.enabled()
    lib = kernels.block_kernels()
    assert isinstance(lib.vq_matmul, ctypes._CFuncPtr) and isinstance(lib.vq_matmul_small, ctypes._CFuncPtr)


def test_engine_prints_the_breakdown(monkeypatch, tiny_llama_dir, capsys):
    """A real engine with the switch on: every phase printed, forward's C kernels under it, steps counted."""
    from vllmpy import LLM, SamplingParams

    monkeypatch.setenv("VLLMPY_PROFILE", "1")
    prof = StepProfile(every=1000, stream=None)
    monkeypatch.setattr(profiling, "_profile", prof)
    for accessor in (kernels.block_kernels, kernels.attention_kernels, kernels.layer_kernels):
        accessor.cache_clear()  # rebuilt with timed calls
    try:
        llm = LLM(model=tiny_llama_dir, num_blocks=16, max_model_len=64)
        llm.generate(["Hello there", "A"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        for accessor in (kernels.block_kernels, kernels.attention_kernels, kernels.layer_kernels):
            accessor.cache_clear()  # the other tests get untimed libraries
    prof.print_total()
    report = capsys.readouterr().err.split("vllmpy profile")[-1]
    assert "all 4 steps" in report, report  # one prefill step, three decode steps
    step_ms = float(re.search(r"([\d.]+) ms/step wall", report).group(1))
    phases = [_ms(report, profiling._LABELS.get(phase, phase)) for phase in PHASES]
    assert all(ms >= 0.0 for ms in phases) and _ms(report, "forward") > 0.0
    assert sum(phases) <= step_ms + 0.01 and _ms(report, "unattributed") < 0.5 * step_ms
    assert re.search(r"^\s+layer ops kernels\s+[\d.]+ ms", report, re.M), report
