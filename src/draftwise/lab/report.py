"""Write a bench's report: `results.json` (`results.py`), `report.md` and the PNG plots (`plots.py`).

`markdown` assembles the report: a header naming the command and the machine, a summary of where
speculation pays off (`findings`, the speedup and policy matrices, `policy_compare`), then one
section per workload made of the tables in `tables.py`.
"""
from __future__ import annotations

import json
from pathlib import Path

from .plots import plot_workload
from .policy_compare import policy_matrix, policy_points, policy_summary
from .tables import (acceptance_table, capacity_table, distribution_table, speedup_matrix, steal_line,
                     structured_output_table, workload_table)


def _round_cost(run: dict, none: dict | None) -> str:
    """The suffix " (L tokens per round, each taking the engine time of R plain tokens)"; speedup ~ L / R."""
    sp = run.get("speculation") or {}
    length = sp.get("mean_accepted_length")
    ms = (sp.get("ms_per_token") or {}).get("total")
    ms_none = ((none or {}).get("speculation") or {}).get("ms_per_token", {}).get("total")
    if not (length and ms and ms_none):
        return ""
    return f" ({length:.2f} tokens per round, each taking the engine time of {length * ms / ms_none:.2f} plain tokens)"


def findings(wl: dict) -> list[str]:
    """One line per speculative config: where it pays off against `none`."""
    out = []
    configs = [c for c in dict.fromkeys(r["config"] for r in wl["runs"]) if c != "none"]
    base = {r["level_label"]: r for r in wl["runs"] if r["config"] == "none"}
    for c in configs:
        runs = [r for r in wl["runs"] if r["config"] == c and r.get("vs_none") and r["vs_none"]["speedup"]]
        if not runs:
            continue
        wins = [r["level_label"] for r in runs if r["vs_none"]["speedup"] >= 1.05]
        best = max(runs, key=lambda r: r["vs_none"]["speedup"])
        worst = min(runs, key=lambda r: r["vs_none"]["speedup"])
        where = f"faster (>= 1.05x) at {', '.join(wins)}" if wins else "never faster by 5% or more"
        out.append(f"`{c}`: {where}; best {best['vs_none']['speedup']:.2f}x at {best['level_label']}"
                   f"{_round_cost(best, base.get(best['level_label']))}, worst {worst['vs_none']['speedup']:.2f}x at "
                   f"{worst['level_label']}{_round_cost(worst, base.get(worst['level_label']))}.")
    return out


COLUMNS = ("Columns: ITL = time between deliveries (a speculative round delivers its tokens together); "
           "TPOT = (E2E - TTFT) / (tokens - 1); ms/token = engine time per committed output token split into "
           "drafting + verification + scheduling/state; grammar ms/step = structured output's mask and matcher "
           "work per engine step (part of drafting + verification), and its share of `none`'s engine time per "
           "step (prefill steps included) at the same level; speedup and goodput ratio are against `none` at the same "
           "level (with --url and --reference-url: against the reference server's run at that level); greedy "
           "mismatches count requests whose token ids differ from `none`'s (or the reference's).")


def markdown(results: dict, title: str = "draftwise bench", image_prefix: str = "") -> str:
    lines = _header(results, title, image_prefix) + _summary(results)
    for wl in results["workloads"]:
        lines += _workload_section(wl, image_prefix)
    return "\n".join(lines)


def _header(results: dict, title: str, image_prefix: str) -> list[str]:
    """The title, the command that produced the report, the machine and the settings."""
    env = results["environment"]
    took = results.get("wall_seconds")
    return [f"# {title}", "",
            "Produced by one command" + (f" in {took / 60:.1f} minutes on the machine below" if took else "") + ":", "",
            f"    {' '.join(results['command'])}", "",
            f"Raw figures: `{image_prefix}results.json`; the per-run report: `{image_prefix}report.md`.", "",
            f"{results['created']} · {env['cpu']} ({env['cpu_count']} CPUs, {env['torch_threads']} torch threads)"
            + (f" · GPU {env['gpu']}" if env["gpu"] else "") + f" · torch {env['torch']} · commit {env['git_commit']}",
            "", f"Settings: {json.dumps(results['settings'])}", "", COLUMNS, ""]


def _summary(results: dict) -> list[str]:
    """Per workload, where each speculative config pays off; then the load-aware policies."""
    lines = ["## Summary: where speculation pays off", ""]
    points = policy_points(results)
    for wl in results["workloads"]:
        lines += [f"**{wl['name']}**", ""] + [f"- {x}" for x in findings(wl)] + [""]
        for m in (speedup_matrix(wl), policy_matrix(wl, points)):
            if m:
                lines += [m, ""]
    summary = policy_summary(results)
    if summary:
        lines += ["Load-aware policies against the better fixed choice at each point (output tok/s over "
                  "max(`none`, the same config verifying every proposal)):", ""] + [f"- {x}" for x in summary] + [""]
    return lines


def _workload_section(wl: dict, image_prefix: str) -> list[str]:
    """One workload: what its requests were, its tables (those it has figures for) and its plots."""
    chat = {"model": ", chat messages rendered with the model's chat template",
            "plain": ", chat messages rendered with the plain template (the model has none)"}.get(
                wl.get("chat_template"), "")
    truncated = (f", {wl['truncated_prompts']} prompts truncated to fit the context"
                 if wl.get("truncated_prompts") else "")
    lines = [f"## {wl['name']}", "", f"{wl['num_requests']} requests{truncated}{chat}.", "", workload_table(wl), ""]
    acc = acceptance_table(wl)
    parts = [steal_line(wl), "Acceptance:\n\n" + acc if acc else "", distribution_table(wl),
             structured_output_table(wl), capacity_table(wl)]
    for part in parts:
        if part:
            lines += [part, ""]
    plots = wl.get("plots", [])
    lines += [f"![{Path(p).stem}]({image_prefix}{p})" for p in plots] + ([""] if plots else [])
    return lines


def write_report(results: dict, out: Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for wl in results["workloads"]:
        wl["plots"] = plot_workload(wl, out)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "report.md").write_text(markdown(results) + "\n")
