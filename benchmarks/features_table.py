"""Render FEATURES.md's model-table rows from the gate report.

    VLLMPY_GATE_REPORT=gate.json pytest tests/models/test_gate_transformers.py
    python benchmarks/features_table.py gate.json [--write FEATURES.md]

prints one `| key | architecture | gated on | verdict |` row per gate id (an architecture, or
`Architecture/variant` for a second config of it), then the architectures we leave ungated because
transformers has no implementation to gate against. With --write, the rows replace those between the
model-table markers of that file.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

# Asked for, but transformers 5.24 has no implementation (the oracle), so they are not gated or served.
NOT_IN_TRANSFORMERS = {
    "InternLM2ForCausalLM": "transformers 5.24 has no InternLM2 (remote code only); not supported",
}


def row_key(gate_id: str) -> str:
    arch, _, variant = gate_id.partition("/")
    family = re.sub(r"(ForCausalLM|LMHeadModel)$", "", re.sub(r"ForConditionalGeneration$", "-vl", arch)).lower()
    return f"model.{family}" + (f".{variant}" if variant else "")


def verdict(entry: dict) -> str:
    n = entry["prompts"]
    if not entry["passed"]:
        return f"✘ {entry['failures']} of {n} prompts fail (strict {entry['strict']}, near-tie {entry['near_tie']})"
    text = f"✅ strict {entry['strict']}/{n}"
    if entry["near_tie"]:
        text += f", near-tie {entry['near_tie']}/{n}"
    return f"{text} (max logprob err {entry['max_logprob_err']:.0e})"


def rows(report: dict[str, dict]) -> list[str]:
    out = []
    for gate_id, entry in sorted(report.items(), key=lambda item: row_key(item[0])):
        arch = entry["architecture"] + (f" ({entry['variant']})" if entry.get("variant") else "")
        out.append(f"| {row_key(gate_id)} | {arch} | tiny: {entry['description']} | {verdict(entry)} |")
    for arch, why in NOT_IN_TRANSFORMERS.items():
        out.append(f"| {row_key(arch)} | {arch} | — | ☐ {why} |")
    return out


START, END = "<!-- model-table:start -->", "<!-- model-table:end -->"


def write_rows(path: str, lines: list[str]) -> None:
    with open(path) as f:
        text = f.read()
    head, start, rest = text.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise SystemExit(f"{path}: no {START} ... {END} markers")
    table = "| key | architecture | gated on | verdict |\n|---|---|---|---|\n" + "\n".join(lines)
    with open(path, "w") as f:
        f.write(f"{head}{START}\n{table}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="the JSON file VLLMPY_GATE_REPORT named")
    parser.add_argument("--write", metavar="FEATURES_MD", help="replace the model table between the markers")
    args = parser.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    lines = rows(report)
    if args.write:
        write_rows(args.write, lines)
    else:
        print("\n".join(lines))
    return 0 if all(entry["passed"] for entry in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
