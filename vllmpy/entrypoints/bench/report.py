"""A benchmark report: the header that attributes the run, then the figures; text for stdout, JSON for files."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# Label column width of the report (the KV dtype lines of USAGE are printed in this layout).
LABEL_WIDTH = 43

Figure = float | int | None


def summarize(values: Sequence[float], prefix: str, scale: float = 1.0,
              percentiles: Sequence[int] = (50, 99)) -> dict[str, Figure]:
    """`{prefix}_mean`, `{prefix}_p50`, ... of `values * scale`; None when there are no values."""
    data = np.asarray(values, dtype=float) * scale
    out: dict[str, Figure] = {f"{prefix}_mean": float(data.mean()) if data.size else None}
    for p in percentiles:
        out[f"{prefix}_p{p}"] = float(np.percentile(data, p)) if data.size else None
    return out


def _line(label: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.3f}"
    elif value is None:
        value = "n/a"
    return f"{label + ':':<{LABEL_WIDTH}}{value}"


@dataclass
class Report:
    mode: str
    header: dict[str, str]
    results: dict[str, Figure]
    args: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        rule = "=" * (LABEL_WIDTH + 20)
        lines = [rule, f"vllm-bench {self.mode}".center(len(rule)), rule]
        lines += [_line(k, v) for k, v in self.header.items()]
        lines.append("-" * len(rule))
        lines += [_line(k, v) for k, v in self.results.items()]
        lines += [f"note: {n}" for n in self.notes]
        lines.append(rule)
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"mode": self.mode, "header": self.header, "results": self.results, "args": self.args,
                "notes": self.notes}

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")
