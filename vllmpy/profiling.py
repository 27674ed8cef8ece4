"""VLLMPY_PROFILE=1: where an engine step's time goes, printed to stderr every VLLMPY_PROFILE_EVERY steps
(default 100) and at exit.

Phases: schedule, input prep, model forward (split into the packed-matmul C kernels, the attention C
kernel, the layer-op C kernels and the rest: torch ops and Python dispatch), logits (the LM head: its
matmul kernel and the rest), sampler, update / stop pass, and the time outside the core step while
requests are running (output processing, detokenization, the caller's loop; in the server, the engine
loop's queue and SSE hand-off). Off, nothing here runs: `attach` and `time_c_calls` are called only when
the switch is on, and they wrap the engine's methods and the ctypes functions in timers then.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TextIO

# Top-level phases in print order; "outside" closes the step: the gap until the next core step.
PHASES = ("schedule", "input prep", "forward", "logits", "sampler", "update/stop", "outside")
KERNEL_KINDS = ("packed matmul", "attention", "layer ops")
_LABELS = {"outside": "outside the step (outputs, detokenize, caller)"}


def enabled() -> bool:
    """Whether VLLMPY_PROFILE asks for the breakdown (read when an engine or kernel library is built)."""
    return os.environ.get("VLLMPY_PROFILE", "") not in ("", "0")


class StepProfile:
    """Seconds per phase and per (phase, kernel kind), over a window of steps and over the whole run."""

    def __init__(self, every: int, stream: TextIO | None = None) -> None:
        self.every, self.stream = every, stream
        self.lock = threading.Lock()
        self.window, self.total = _Tally(), _Tally()
        self.phase: str | None = None  # the top-level phase running now (kernel time is charged to it)
        self.step_end: float | None = None  # end of the last core step while requests remained

    def add(self, phase: str, seconds: float) -> None:
        with self.lock:
            for tally in (self.window, self.total):
                tally.phases[phase] += seconds

    def add_kernel(self, kind: str, seconds: float) -> None:
        with self.lock:
            for tally in (self.window, self.total):
                tally.kernels[(self.phase or "other", kind)] += seconds

    def end_step(self, wall: float, tokens: int) -> None:
        """One core step done (`wall` seconds since the previous one closed); prints every `every` steps."""
        with self.lock:
            for tally in (self.window, self.total):
                tally.steps += 1
                tally.wall += wall
                tally.tokens += tokens
            if self.window.steps < self.every:
                return
            window, self.window = self.window, _Tally()
        self.print(window, f"last {window.steps} steps")

    def print(self, tally: _Tally, title: str) -> None:
        print(tally.report(title), file=self.stream or sys.stderr, flush=True)

    def print_total(self) -> None:
        if self.total.steps:
            self.print(self.total, f"all {self.total.steps} steps")


class _Tally:
    def __init__(self) -> None:
        self.steps, self.wall, self.tokens = 0, 0.0, 0
        self.phases: defaultdict[str, float] = defaultdict(float)
        self.kernels: defaultdict[tuple[str, str], float] = defaultdict(float)

    def report(self, title: str) -> str:
        """Per-step milliseconds and shares of the step wall time, the C kernels under their phase."""
        steps = max(self.steps, 1)

        def line(label: str, seconds: float, indent: int = 2) -> str:
            share = 100.0 * seconds / self.wall if self.wall else 0.0
            return f"{' ' * indent}{label:<{50 - indent}}{1e3 * seconds / steps:9.3f} ms {share:6.1f}%"

        lines = [f"vllmpy profile ({title}): {1e3 * self.wall / steps:.3f} ms/step wall, "
                 f"{self.tokens / steps:.1f} tokens/step"]
        for phase in PHASES:
            seconds = self.phases.get(phase, 0.0)
            lines.append(line(_LABELS.get(phase, phase), seconds))
            kernels = {kind: self.kernels[(phase, kind)] for kind in KERNEL_KINDS if (phase, kind) in self.kernels}
            if kernels:
                for kind, spent in kernels.items():
                    lines.append(line(f"{kind} kernels", spent, 4))
                lines.append(line("rest (torch ops, Python dispatch)", seconds - sum(kernels.values()), 4))
        lines.append(line("unattributed", self.wall - sum(self.phases.get(p, 0.0) for p in PHASES)))
        return "\n".join(lines)


_profile: StepProfile | None = None


def profile() -> StepProfile:
    """The process's profile (made on first use, printed at exit)."""
    global _profile
    if _profile is None:
        _profile = StepProfile(int(os.environ.get("VLLMPY_PROFILE_EVERY", "100")))
        atexit.register(_profile.print_total)
    return _profile


def _timed(phase: str, fn: Callable[..., Any], prof: StepProfile) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        outer, prof.phase = prof.phase, phase
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            prof.add(phase, time.perf_counter() - start)
            prof.phase = outer
    return wrapper


def attach(core: Any, prof: StepProfile | None = None) -> None:
    """Time `core`'s step and its phases by wrapping the methods that run them on these instances."""
    prof = prof or profile()
    scheduler, runner, model = core.scheduler, core.runner, core.runner.model
    for owner, name, phase in ((scheduler, "schedule", "schedule"), (runner, "_update_states", "input prep"),
                               (runner, "_prepare", "input prep"), (model, "forward", "forward"),
                               (model, "compute_logits", "logits"), (runner, "_sample", "sampler"),
                               (scheduler, "update_from_output", "update/stop")):
        setattr(owner, name, _timed(phase, getattr(owner, name), prof))
    step = core.step

    @functools.wraps(step)
    def timed_step(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        if prof.step_end is not None:  # the caller's work on the previous step's outputs
            prof.add("outside", start - prof.step_end)
        opened = prof.step_end if prof.step_end is not None else start
        result = step(*args, **kwargs)
        end = time.perf_counter()
        scheduler_output = result[2]
        if scheduler_output.is_empty:
            prof.step_end = None
            return result
        prof.end_step(end - opened, sum(len(chunk.token_ids) for chunk in scheduler_output.chunks))
        prof.step_end = end if core.has_unfinished_requests() else None  # idle waits are nobody's phase
        return result
    core.step = timed_step


def time_c_calls(lib: ctypes.CDLL, kind: str, names: tuple[str, ...], prof: StepProfile | None = None) -> None:
    """Wrap lib's bound functions `names` in timers charged to `kind` under the running phase."""
    prof = prof or profile()
    for name in names:
        fn = getattr(lib, name)

        def wrapper(*args: Any, _fn: Callable[..., Any] = fn) -> Any:
            start = time.perf_counter()
            try:
                return _fn(*args)
            finally:
                prof.add_kernel(kind, time.perf_counter() - start)
        setattr(lib, name, wrapper)
