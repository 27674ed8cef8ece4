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


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("VLLMPY_GATE_REPORT")
    if not path or not _VERDICTS:
        return
    report = Path(path)
    merged = json.loads(report.read_text()) if report.exists() else {}
    merged.update(_VERDICTS)
    report.write_text(json.dumps(dict(sorted(merged.items())), indent=2) + "\n")
