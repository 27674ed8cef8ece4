"""benchmarks/markdown.py renders BENCHMARKS.md from a peers.py run: both dtypes of vllmpy and vLLM, the
comparison with vLLM's better dtype, the batch-scaling table and the achieved bandwidth, and still renders
runs saved before those fields existed (the d34960a run, kept in tests/unit/data)."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
OLD_RUN = Path(__file__).resolve().parent / "data" / "peers_run_d34960a.json"
sys.path.insert(0, str(BENCHMARKS))

import markdown  # noqa: E402


def old_run() -> dict:
    return json.loads(OLD_RUN.read_text())


def two_dtype_run() -> dict:
    """The saved run with bf16 engines added: vllmpy bf16 at 120 tok/s, vLLM fp32 50, vLLM bf16 80 on (a)."""
    run = copy.deepcopy(old_run())
    a = run["workloads"]["a"]
    a["runs"] = {"vllmpy": [100.0], "vllmpy bf16": [120.0], "llama.cpp": [90.0], "vllm": [50.0],
                 "vllm bf16": [80.0]}
    a["extra"], a["skipped"] = {}, {}
    scaling = {"vllmpy": {"1": [10.0], "4": [30.0], "16": [64.0], "64": [90.0]},
               "vllm bf16": {"1": [8.0], "16": [40.0]}}
    run["workloads"] = {"a": a, "g": {"title": "(g) Batch scaling", "metric": "output tok/s", "how": "h",
                                      "command": "c", "runs": {}, "extra": {}, "batches": scaling,
                                      "skipped": {"llama.cpp": "one at a time"}}}
    run["limit"].update({"vllmpy bf16": 250_000_000, "bfloat16": 500_000_000})
    run["engines"] += [{"engine": "vllmpy bf16", "version": "v", "weights": "packed, bf16", "batching": "b"},
                       {"engine": "vllm bf16", "version": "v", "weights": "bf16", "batching": "b"}]
    run["dtypes"], run["dtype_note"] = ["float32", "bfloat16"], "vllmpy and vLLM each in float32 and bfloat16"
    run["vllmpy_headers"] = {"vllmpy": run["vllmpy_header"], "vllmpy bf16": {**run["vllmpy_header"],
                                                                            "Dtype": "bfloat16"}}
    return run


def row(document: str, engine: str, after: str) -> list[str]:
    """The cells of `engine`'s first table row after the line starting with `after`."""
    lines = document[document.index(after):].splitlines()
    line = next(line for line in lines if line.startswith(f"| {engine} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_old_run_renders_without_the_new_fields():
    document = markdown.document(old_run())
    assert "bf16" not in markdown.tables(old_run())
    assert "predates --dtypes" in document
    # The achieved-bandwidth line derives from what old runs saved: 94.5 tok/s x 246.6 MB over 44.5 GB/s.
    assert row(document, "vllmpy", "## Physical limit")[-1] == "23.3 / 44.5 (52%)"


def test_both_dtypes_and_the_better_dtype_column():
    run = two_dtype_run()
    document = markdown.document(run)
    header = row(document, "engine", "### (a)")
    assert header[5:8] == ["vllmpy / engine", "vllmpy bf16 / engine", "vllmpy / vllm's better dtype (vllm bf16)"]
    vllmpy, ours_bf16 = row(document, "vllmpy", "### (a)"), row(document, "vllmpy bf16", "### (a)")
    assert vllmpy[5:8] == ["1.00x", "1.20x", "1.25x"]  # 100 / 80: against vLLM's faster dtype, bf16
    assert ours_bf16[7] == "1.50x"  # 120 / 80
    assert row(document, "llama.cpp", "### (a)")[7] == ""  # the column compares vllmpy's rows only
    assert "- `vllmpy bf16` differs in: Dtype: bfloat16" in document
    assert row(document, "vllmpy bf16", "## Physical limit")[-1] == "30.0 / 44.5 (67%)"
    assert row(document, "vllm bf16", "## Physical limit")[-1] == "40.0 / 44.5 (90%)"


def test_scaling_table():
    document = markdown.document(two_dtype_run())
    assert row(document, "vllmpy", "### (g)")[2:] == ["10.0", "30.0", "64.0", "90.0", "6.40x"]
    assert row(document, "vllm bf16", "### (g)")[2:] == ["8.00", "", "40.0", "", "5.00x"]
    assert row(document, "llama.cpp", "### (g)")[2] == "not measured"


def spec_run() -> dict:
    """The saved run with speculation rows: (d) with `vllmpy ngram` beside plain vllmpy (its `x spec-off` and
    acceptance), (e) with llama-server's --spec-type engine, whose acceptance has no drafting-step count."""
    run = copy.deepcopy(old_run())
    d = run["workloads"]["d"]
    d["runs"]["vllmpy ngram"] = [95.0, 99.0]
    d["runs"]["vllmpy"] = [100.0, 100.0]
    for engine, extra in d["extra"].items():
        extra["x spec-off"] = [1.0] * 2 if engine == "vllmpy" else [0.9] * 2
    d["extra"]["vllmpy ngram"] = {**{k: v[:2] for k, v in d["extra"]["vllmpy"].items()}, "x spec-off": [0.95, 0.99]}
    d["acceptance"] = {"vllmpy ngram": [{"acceptance_rate": 0.5, "mean_acceptance_length": 2.0, "drafts": 4},
                                        {"acceptance_rate": None, "mean_acceptance_length": None, "drafts": 0}]}
    e = {"title": "(e) Code edit", "metric": "decode tok/s", "how": "h", "command": "c", "skipped": {},
         "runs": {"vllmpy": [40.0], "vllmpy ngram": [120.0], "llama-server ngram-mod": [80.0]},
         "extra": {name: {"x spec-off": [rate / 40.0]} for name, rate in
                   (("vllmpy", 40.0), ("vllmpy ngram", 120.0), ("llama-server ngram-mod", 80.0))},
         "acceptance": {"vllmpy ngram": [{"acceptance_rate": 0.9, "mean_acceptance_length": 6.0, "drafts": 80}],
                        "llama-server ngram-mod": [{"acceptance_rate": 0.75, "mean_acceptance_length": None,
                                                    "drafts": 0, "draft_tokens": 400}]}}
    run["workloads"] = {"d": d, "e": e}
    return run


def test_speculation_rows_in_serving_and_code_edit():
    document = markdown.document(spec_run())
    header = row(document, "engine", "### (d)")
    assert header[-2:] == ["x spec-off", "draft acceptance (median)"]
    ngram = row(document, "vllmpy ngram", "### (d)")
    assert ngram[2] == "97.0" and ngram[5] == "1.03x"  # median 97 against plain vllmpy's 100
    assert ngram[-2:] == ["0.97", "0.50"]  # runs without drafts do not count
    assert row(document, "vllmpy", "### (d)")[-1] == ""
    assert row(document, "llama-server ngram-mod", "### (e)")[-2:] == ["2.00", "0.75"]
    assert row(document, "vllmpy ngram", "### (e)")[5] == "0.33x"
    assert "acceptance" not in markdown.document(old_run())
