"""Write a bench's results: `results.json` (versioned schema), `report.md`, and PNG plots.

Schema "draftwise.bench/1": {schema, wall_seconds, created, command, environment, settings, workloads: [{name,
num_requests, sampled, truncated_prompts, runs: [{config, level, level_label, <metrics.summarize
fields>, speculation, memory, vs_none, correctness}], distribution: {config: {...}}}]}.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
from pathlib import Path

from ..policies.profile import machine_info

SCHEMA = "draftwise.bench/1"


def environment() -> dict:
    import torch

    cpu = machine_info()["cpu"]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    commit = None
    try:
        repo = Path(__file__).resolve().parents[3]
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                timeout=5).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        if commit and not all(c in "0123456789abcdef" for c in commit):
            commit = None  # not a git checkout
        if commit and dirty:
            commit += "-dirty"
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu": cpu, "cpu_count": os.cpu_count(), "gpu": gpu, "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "git_commit": commit,
    }


def build_results(workloads: list[dict], settings: dict, command: list[str], wall_seconds: float | None = None) -> dict:
    return {
        "wall_seconds": wall_seconds,
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "environment": environment(),
        "settings": settings,
        "workloads": workloads,
    }


# ------------------------------------------------------------------------------ markdown
def _f(x, fmt="{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def workload_table(wl: dict) -> str:
    head = ("| config | level | out tok/s | req/s | goodput/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
            "TPOT p50 / p99 ms | E2E p50 / p99 ms | accepted len | ms/token draft+verify+other | "
            "grammar ms/step (% of a plain step) | peak RSS MiB | prefix cache hits | $/Mtok | speedup | goodput ratio | greedy mismatches |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    plain_step = {r["level_label"]: (r.get("speculation") or {}).get("step_ms")
                  for r in wl["runs"] if r["config"] == "none"}
    for r in wl["runs"]:
        sp = r.get("speculation") or {}
        ms = sp.get("ms_per_token") or {}
        gram, plain = sp.get("grammar_ms_per_step"), plain_step.get(r["level_label"])
        gram = "–" if gram is None else f"{gram:.2f}" + (f" ({100 * gram / plain:.1f}%)" if plain else "")
        vs = r.get("vs_none") or {}
        cor = r.get("correctness")
        mism = "–" if not cor else f"{cor['mismatching_requests']}/{cor['compared']}" + (
            f" (first at {cor['first_differing_position']}, {cor.get('near_ties', '?')} near-ties)"
            if cor["mismatching_requests"] else "")
        mem = (r.get("memory") or {}).get("peak_rss_mib")
        split = ("–" if not ms else f"{ms['drafting']:.2f}+{ms['verification']:.2f}+{ms['scheduling_state']:.2f}"
                 f" = {ms['total']:.2f}" + (f" (rollback {ms['rollback']:.3f})" if ms.get("rollback") else ""))
        rec = r.get("recurrent")
        mem_cell = _f(mem, "{:.0f}") + ("" if not rec else f" (recurrent: {rec['state_kib_per_seq']:.0f} KiB/seq, "
                                                          f"scratch {rec['scratch_peak_kib']:.0f} KiB)")
        rows.append(
            f"| {r['config']} | {r['level_label']} | {_f(r['output_tokens_per_s'])} | {_f(r['requests_per_s'], '{:.2f}')} "
            f"| {_f(r['goodput_requests_per_s'], '{:.2f}')} "
            f"| {_f(r['ttft_ms']['p50'], '{:.0f}')} / {_f(r['ttft_ms']['p99'], '{:.0f}')} "
            f"| {_f(r['itl_ms']['p50'])} / {_f(r['itl_ms']['p99'])} "
            f"| {_f(r['tpot_ms']['p50'])} / {_f(r['tpot_ms']['p99'])} "
            f"| {_f(r['e2e_ms']['p50'], '{:.0f}')} / {_f(r['e2e_ms']['p99'], '{:.0f}')} "
            f"| {_f(sp.get('mean_accepted_length'), '{:.2f}')} | {split} | {gram} | {mem_cell} "
            f"| {_f(sp.get('prefix_cache_hit_rate'), '{:.0%}')} "
            f"| {_f(r.get('cost_per_million_output_tokens'), '{:.2f}')} "
            f"| {_f(vs.get('speedup'), '{:.2f}x')} | {_f(vs.get('goodput_ratio'), '{:.2f}x')} | {mism} |")
    return "\n".join(rows)


def steal_line(wl: dict) -> str:
    """The hypervisor's share of the CPU time during the measured runs (`steal.py`), every round
    of every config and level: the noise a co-tenant put into these figures."""
    rounds = []
    for r in wl["runs"]:
        shares = (r.get("rounds") or {}).get("steal_share") or [r.get("steal_share")]
        rounds += [(x, r["config"], r["level_label"]) for x in shares if x is not None]
    if not rounds:
        return ""
    rounds.sort(key=lambda t: t[0])
    lo, mid, hi = rounds[0], rounds[len(rounds) // 2], rounds[-1]
    return (f"CPU time taken by the hypervisor (steal, /proc/stat) during the {len(rounds)} measured runs: median "
            f"{mid[0]:.1%}, from {lo[0]:.1%} ({lo[1]} {lo[2]}) to {hi[0]:.1%} ({hi[1]} {hi[2]}).")


def acceptance_table(wl: dict) -> str:
    rows = ["| config | level | rounds | acceptance rate | acceptance by position | committed per round (tokens: rounds) "
            "| verified per round (proposals: rounds) | rounds / steps speculating "
            "| step time measured / predicted, median (profile alone) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in wl["runs"]:
        sp = r.get("speculation") or {}
        if not sp or not sp.get("proposed_tokens"):
            continue
        pos = " ".join(f"{a:.2f}" for a in sp["acceptance_by_position"])
        hist = " ".join(f"{k}:{v}" for k, v in sp["committed_per_round"].items())
        vhist = " ".join(f"{k}:{v}" for k, v in (sp.get("verified_per_round") or {}).items())
        share = f"{_f(sp.get('rounds_speculating'), '{:.0%}')} / {_f(sp.get('steps_speculating'), '{:.0%}')}"
        pred = sp.get("step_time_measured_over_predicted") or {}
        rows.append(f"| {r['config']} | {r['level_label']} | {sp['rounds']} | {_f(sp['acceptance_rate'], '{:.2f}')} "
                    f"| {pos} | {hist} | {vhist} | {share} | {_f(pred.get('median'), '{:.2f}')} "
                    f"({_f(pred.get('median_profile_only'), '{:.2f}')}) |")
    return "\n".join(rows) if len(rows) > 2 else ""


def capacity_table(wl: dict) -> str:
    cap = wl.get("capacity") or {}
    if not cap:
        return ""
    first = next(iter(cap.values()))
    slo = ", ".join(f"{k} p90 <= {v:g} ms" for k, v in first["slo_ms"].items())
    base = (cap.get("none") or {}).get("requests_per_s")
    rows = [f"Capacity (`--find-capacity`): the highest Poisson request rate at which every request completes "
            f"and {slo}.", "", "| config | requests/s at the latency limit | vs none | first failing rate | probes |",
            "|---|---|---|---|---|"]
    for label, c in cap.items():
        ratio = c["requests_per_s"] / base if base else None
        probes = " ".join(f"{p['rate']:.3g}{'✓' if p['held'] else '✗'}" for p in c["probes"])
        rows.append(f"| {label} | {c['requests_per_s']:.3g} | {_f(ratio, '{:.2f}x')} "
                    f"| {_f(c['first_failing_rate'], '{:.3g}')} | {probes} |")
    unbounded = [(label, c) for label, c in cap.items() if c["probes"] and c["first_failing_rate"] is None]
    if unbounded:
        peaks = ", ".join(f"{label} {max(p['achieved_requests_per_s'] for p in c['probes']):.3g}"
                          for label, c in unbounded)
        rows += ["", f"Not converged: the SLO held at every rate probed, so those figures are the search's last "
                 f"rate, not a capacity. The engine completed at most (requests/s): {peaks}. A TPOT or ITL limit "
                 f"alone does not see requests queueing past saturation: add a TTFT or E2E limit "
                 f"(e.g. `--slo tpot=MS,ttft=MS`)."]
    return "\n".join(rows)


def distribution_table(wl: dict) -> str:
    if not wl.get("distribution"):
        return ""
    s = wl["distribution_settings"]
    rows = [f"Sampled-output check at temperature {s['temperature']:g}: {s['samples']} seeded samples of the "
            f"first {s['horizon']} tokens of {s['prompts']} prompts per config, chi-square per position vs `none` "
            f"(informative = at least two cells after pooling tokens seen fewer than 10 times).",
            "", "| config | tests (informative) | Bonferroni p | max TV | mean TV |", "|---|---|---|---|---|"]
    for label, d in wl["distribution"].items():
        rows.append(f"| {label} | {d['tests']} ({d['informative_tests']}) | {d['p_value']:.3f} | {d['max_tv']:.3f} "
                    f"| {d['mean_tv']:.3f} |")
    return "\n".join(rows)


def structured_output_table(wl: dict) -> str:
    runs = [r for r in wl["runs"] if r.get("structured_output")]
    if not runs:
        return ""
    rows = ["Structured output (each constrained request's tokens fed to a fresh grammar matcher):", "",
            "| config | level | complete | valid prefix (max_tokens) | invalid |", "|---|---|---|---|---|"]
    for r in runs:
        c = r["structured_output"]
        rows.append(f"| {r['config']} | {r['level_label']} | {c['complete']} | {c['valid_prefix']} | {c['invalid']} |")
    return "\n".join(rows)


def speedup_matrix(wl: dict) -> str:
    """Rows = speculative configs, columns = levels: output tok/s speedup over `none`."""
    levels = list(dict.fromkeys(r["level_label"] for r in wl["runs"]))
    configs = [c for c in dict.fromkeys(r["config"] for r in wl["runs"]) if c != "none"]
    if not configs:
        return ""
    cell = {(r["config"], r["level_label"]): (r.get("vs_none") or {}).get("speedup") for r in wl["runs"]}
    base = {r["level_label"]: r["output_tokens_per_s"] for r in wl["runs"] if r["config"] == "none"}
    rows = ["| speedup vs none | " + " | ".join(levels) + " |", "|---|" + "---|" * len(levels),
            "| none (out tok/s) | " + " | ".join(_f(base.get(lv)) for lv in levels) + " |"]
    for c in configs:
        rows.append(f"| {c} | " + " | ".join(
            ("**" + _f(cell.get((c, lv)), "{:.2f}x") + "**") if (cell.get((c, lv)) or 0) >= 1.05
            else _f(cell.get((c, lv)), "{:.2f}x") for lv in levels) + " |")
    return "\n".join(rows)


def _strip(label: str, key: str) -> str:
    return ":".join(x for x in label.split(":") if not x.startswith(key + "="))


def _fixed_counterpart(label: str) -> str | None:
    """"draft:k=4:policy=goodput" -> "draft:k=4" (the same config, every proposal verified); an A/A
    copy ("draft:k=4:copy=2", bench's `copy=N`) -> its original, judged as a load-aware policy is
    (what a policy no better than fixed speculation scores there); None for any other config."""
    base = _strip(label, "copy")
    parts = base.split(":")
    policy = [x for x in parts if x.startswith("policy=")]
    if policy and policy[0] != "policy=fixed":
        return _strip(base, "policy")
    return base if base != label else None


def _rates(wl: dict) -> dict[tuple[str, str], float]:
    """(config, level) -> output tok/s of a workload's runs."""
    return {(r["config"], r["level_label"]): r["output_tokens_per_s"] for r in wl["runs"]}


def policy_points(results: dict) -> dict[str, list[tuple[str, str, float]]]:
    """Per config with a load-aware policy (or an A/A copy): (workload, level, its output tok/s
    over the better of `none` and its fixed counterpart at that point), where both ran at that
    point: the question such a policy answers (is it at least as fast as the better fixed choice,
    at every load?)."""
    out: dict[str, list[tuple[str, str, float]]] = {}
    for wl in results["workloads"]:
        rate = _rates(wl)
        for (c, lv), v in rate.items():
            base = _fixed_counterpart(c)
            if base is None or (base, lv) not in rate or ("none", lv) not in rate:
                continue
            best = max(rate[("none", lv)], rate[(base, lv)])
            if best > 0:
                out.setdefault(c, []).append((wl["name"], lv, v / best))
    return out


def control_points(results: dict) -> dict[str, list[tuple[str, str, float]]]:
    """Per A/A copy ("X:copy=N"): (workload, level, its output tok/s over X's) where both ran: the
    same config in two engines, so the spread of these ratios is the machine's noise in one cell."""
    out: dict[str, list[tuple[str, str, float]]] = {}
    for wl in results["workloads"]:
        rate = _rates(wl)
        for (c, lv), v in rate.items():
            orig = _strip(c, "copy")
            if orig != c and (orig, lv) in rate and rate[(orig, lv)] > 0:
                out.setdefault(c, []).append((wl["name"], lv, v / rate[(orig, lv)]))
    return out


def _geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def aa_noise(controls: dict[str, list[tuple[str, str, float]]]) -> float:
    """The sd of log(copy / original) over every A/A point (`control_points`)."""
    return statistics.pstdev([math.log(r) for pts in controls.values() for _, _, r in pts])


def policy_summary(results: dict, tolerance: float = 0.03) -> list[str]:
    """One line per load-aware config (and A/A copy): points within `tolerance` of max(none,
    fixed), the geometric mean of the ratios, the lowest; per A/A copy, one more line: its ratios
    to its original (how far noise alone moves a cell)."""
    lines = []
    points = policy_points(results)
    for c, pts in points.items():
        base = _fixed_counterpart(c)
        ok = sum(r >= 1.0 - tolerance for _, _, r in pts)
        low = min(pts, key=lambda x: x[2])
        what = " (an A/A copy, judged as a policy: what one no better than it scores)" if base == _strip(c, "copy") else ""
        lines.append(f"`{c}` against the better of `none` and `{base}`{what}: within {tolerance:.0%} at {ok} of "
                     f"{len(pts)} points; geometric mean {_geomean(r for _, _, r in pts):.3f}; "
                     f"lowest {low[2]:.2f} ({low[0]} {low[1]}).")
    controls = control_points(results)
    if controls:  # the machine's noise in one cell's ratio, from the A/A copies
        sd = aa_noise(controls)
        floor = (1.0 - tolerance) * math.exp(-2 * sd)
        for c, pts in points.items():
            if _strip(c, "copy") != c:
                continue
            far = [f"{w} {lv} {r:.2f}" for w, lv, r in pts if r < floor]
            lines.append(f"`{c}` more than {tolerance:.0%} below max(none, fixed) by more than twice the A/A "
                         f"noise (sd {sd:.3f} of log(copy / original): below {floor:.2f}): {len(far)} of "
                         f"{len(pts)} points" + (f" ({', '.join(far)})" if far else "") + ".")
    for c, pts in controls.items():
        ok = sum(abs(r - 1.0) <= tolerance for _, _, r in pts)
        below = sum(r < 1.0 - tolerance for _, _, r in pts)
        low, high = min(pts, key=lambda x: x[2]), max(pts, key=lambda x: x[2])
        lines.append(f"A/A control `{c}` against `{_strip(c, 'copy')}` (the same config, its own engine): within "
                     f"{tolerance:.0%} either way at {ok} of {len(pts)} points, more than {tolerance:.0%} below at "
                     f"{below}; geometric mean {_geomean(r for _, _, r in pts):.3f}; from {low[2]:.2f} "
                     f"({low[0]} {low[1]}) to {high[2]:.2f} ({high[0]} {high[1]}).")
    return lines


def policy_matrix(wl: dict, results_points: dict[str, list[tuple[str, str, float]]]) -> str:
    """Rows = load-aware configs, columns = levels: output tok/s over max(none, fixed)."""
    rows_of = {c: {lv: r for w, lv, r in pts if w == wl["name"]} for c, pts in results_points.items()}
    rows_of = {c: row for c, row in rows_of.items() if row}
    if not rows_of:
        return ""
    levels = list(dict.fromkeys(r["level_label"] for r in wl["runs"]))
    rows = ["| over max(none, fixed) | " + " | ".join(levels) + " |", "|---|" + "---|" * len(levels)]
    for c, row in rows_of.items():
        rows.append(f"| {c} | " + " | ".join(_f(row.get(lv), "{:.2f}") for lv in levels) + " |")
    return "\n".join(rows)


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


def markdown(results: dict, title: str = "draftwise bench", image_prefix: str = "") -> str:
    env = results["environment"]
    st = results["settings"]
    took = results.get("wall_seconds")
    lines = [f"# {title}", "",
             "Produced by one command" + (f" in {took / 60:.1f} minutes on the machine below" if took else "") + ":", "",
             f"    {' '.join(results['command'])}", "",
             f"Raw figures: `{image_prefix}results.json`; the per-run report: `{image_prefix}report.md`.", "",
             f"{results['created']} · {env['cpu']} ({env['cpu_count']} CPUs, {env['torch_threads']} torch threads)"
             + (f" · GPU {env['gpu']}" if env["gpu"] else "") + f" · torch {env['torch']} · commit {env['git_commit']}",
             "", f"Settings: {json.dumps(st)}", "",
             "Columns: ITL = time between deliveries (a speculative round delivers its tokens together); "
             "TPOT = (E2E - TTFT) / (tokens - 1); ms/token = engine time per committed output token split into "
             "drafting + verification + scheduling/state; grammar ms/step = structured output's mask and matcher "
             "work per engine step (part of drafting + verification), and its share of `none`'s engine time per "
             "step (prefill steps included) at the same level; speedup and goodput ratio are against `none` at the same "
             "level; greedy mismatches count requests whose token ids differ from `none`'s.", ""]
    lines += ["## Summary: where speculation pays off", ""]
    points = policy_points(results)
    for wl in results["workloads"]:
        lines += [f"**{wl['name']}**", ""] + [f"- {x}" for x in findings(wl)] + [""]
        m = speedup_matrix(wl)
        if m:
            lines += [m, ""]
        m = policy_matrix(wl, points)
        if m:
            lines += [m, ""]
    summary = policy_summary(results)
    if summary:
        lines += ["Load-aware policies against the better fixed choice at each point (output tok/s over "
                  "max(`none`, the same config verifying every proposal)):", ""] + [f"- {x}" for x in summary] + [""]
    for wl in results["workloads"]:
        lines += [f"## {wl['name']}", "",
                  f"{wl['num_requests']} requests" + (f", {wl['truncated_prompts']} prompts truncated to fit the context"
                                                     if wl.get("truncated_prompts") else "")
                  + {"model": ", chat messages rendered with the model's chat template",
                     "plain": ", chat messages rendered with the plain template (the model has none)"}.get(
                      wl.get("chat_template"), "") + ".", "",
                  workload_table(wl), ""]
        st = steal_line(wl)
        if st:
            lines += [st, ""]
        acc = acceptance_table(wl)
        if acc:
            lines += ["Acceptance:", "", acc, ""]
        dist = distribution_table(wl)
        if dist:
            lines += [dist, ""]
        so = structured_output_table(wl)
        if so:
            lines += [so, ""]
        cap = capacity_table(wl)
        if cap:
            lines += [cap, ""]
        plots = wl.get("plots", [])
        lines += [f"![{Path(p).stem}]({image_prefix}{p})" for p in plots] + ([""] if plots else [])
    return "\n".join(lines)


# ------------------------------------------------------------------------------ plots
def plot_workload(wl: dict, out: Path) -> list[str]:
    """PNG files (relative names) for one workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    cap = wl.get("capacity") or {}
    if cap:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(list(cap), [c["requests_per_s"] for c in cap.values()])
        ax.set_ylabel("requests/s at the latency limit")
        ax.set_title(f"{wl['name']}: capacity at the SLO")
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        names.append(_save(fig, out, f"{wl['name']}-capacity.png"))
    if not wl["runs"]:
        return names
    configs = list(dict.fromkeys(r["config"] for r in wl["runs"]))
    closed = [r for r in wl["runs"] if r["level"]["kind"] == "concurrency"]
    if closed:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for c in configs:
            rs = sorted((r for r in closed if r["config"] == c), key=lambda r: r["level"]["value"])
            x = [r["level"]["value"] for r in rs]
            axes[0].plot(x, [r["output_tokens_per_s"] for r in rs], marker="o", label=c)
            axes[1].plot(x, [r["tpot_ms"]["p50"] for r in rs], marker="o", label=c)
        for ax, yl in zip(axes, ("output tokens/s", "p50 TPOT (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(yl)
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.suptitle(f"{wl['name']}: throughput and TPOT vs concurrency")
        fig.tight_layout()
        names.append(_save(fig, out, f"{wl['name']}-concurrency.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in configs:
        rs = sorted((r for r in wl["runs"] if r["config"] == c), key=lambda r: r["output_tokens_per_s"])
        ax.plot([r["output_tokens_per_s"] for r in rs], [r["e2e_ms"]["p50"] for r in rs], marker="o", label=c)
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("p50 end-to-end latency (ms)")
    ax.set_title(f"{wl['name']}: latency vs throughput")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    names.append(_save(fig, out, f"{wl['name']}-latency-throughput.png"))
    spec = [c for c in configs if c != "none"]
    if spec:
        fig, ax = plt.subplots(figsize=(6, 4))
        width = 0.8 / len(spec)
        for i, c in enumerate(spec):
            hist: dict[int, int] = {}
            for r in wl["runs"]:
                if r["config"] == c and r.get("speculation"):
                    for k, v in r["speculation"]["committed_per_round"].items():
                        hist[int(k)] = hist.get(int(k), 0) + v
            tot = sum(hist.values()) or 1
            xs = sorted(hist)
            ax.bar([x + i * width for x in xs], [hist[x] / tot for x in xs], width=width, label=c)
        ax.set_xlabel("tokens committed per round")
        ax.set_ylabel("fraction of rounds")
        ax.set_title(f"{wl['name']}: committed per round (all levels)")
        ax.legend()
        fig.tight_layout()
        names.append(_save(fig, out, f"{wl['name']}-committed-per-round.png"))
    return names


def _save(fig, out: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.savefig(out / name, dpi=100)
    plt.close(fig)
    return name


def write_report(results: dict, out: Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for wl in results["workloads"]:
        wl["plots"] = plot_workload(wl, out)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "report.md").write_text(markdown(results) + "\n")
