"""Model-test fixtures: the gate report.

With VLLMPY_GATE_REPORT=path set, every gate verdict is merged into that JSON file (keyed by gate id)
when the session ends; `benchmarks/features_table.py` renders FEATURES.md's model rows from it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


_VERDICTS: dict[str, dict] = {}
_BF16: dict[str, dict] = {}  # the bf16 gate's verdicts: a `bf16` field of the gate id's report entry


@pytest.fixture
def gate_report():
    """record(gate_id, GateResult, description, prompts) for the session's report."""
    import transformers

    def record(gate_id: str, result, description: str, prompts: int) -> None:
        _VERDICTS[gate_id] = {
            "architecture": gate_id.split("/")[0], "variant": gate_id.partition("/")[2] or None,
            "description": description, "prompts": prompts, "strict": result.strict, "near_tie": result.near_tie,
            "failures": len(result.failures), "max_logprob_err": result.max_logprob_err,
            "passed": not result.failures and result.strict + result.near_tie == prompts,
            "transformers": transformers.__version__,
        }
    return record


@pytest.fixture
def bf16_gate_table():
    """record(gate_id, CloseResult, prompts): the bf16 gate's row, printed at the end and kept in the report."""
    def record(gate_id: str, result, prompts: int) -> None:
        _BF16[gate_id] = {"prompts": prompts, "strict": result.strict, "close": len(result.first_divergence),
                          "first_divergence": result.first_divergence, "failures": len(result.failures)}
    return record


def pytest_terminal_summary(terminalreporter):
    if _BF16:
        terminalreporter.write_sep("-", "bf16 gate (check_logprobs_close vs transformers fp32)")
        for gate_id, row in sorted(_BF16.items()):
            terminalreporter.write_line(f"{gate_id:40} strict {row['strict']}/{row['prompts']}  top-5-close "
                                        f"{row['close']} (first divergence {row['first_divergence']})  "
                                        f"failures {row['failures']}")


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("VLLMPY_GATE_REPORT")
    if not path or not (_VERDICTS or _BF16):
        return
    report = Path(path)
    merged = json.loads(report.read_text()) if report.exists() else {}
    merged.update(_VERDICTS)
    for gate_id, row in _BF16.items():
        if gate_id in merged:
            merged[gate_id]["bf16"] = row
    report.write_text(json.dumps(dict(sorted(merged.items())), indent=2) + "\n")
