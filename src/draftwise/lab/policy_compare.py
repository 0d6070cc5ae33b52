"""Load-aware policies against fixed choices, and A/A copies against their originals.

A config with a load-aware policy ("draft:k=4:policy=goodput") answers one question: is it at
least as fast as the better of `none` and the same config verifying every proposal, at every
load? An A/A copy ("draft:k=4:copy=2", the same config in an engine of its own) measures how far
the machine's noise alone moves one cell, and is also judged as a policy would be: what a policy
no better than fixed speculation scores.
"""
from __future__ import annotations

import math
import statistics

from .tables import fmt_cell


def strip_option(label: str, key: str) -> str:
    """A config label without its `key=...` option ("draft:k=4:copy=2", "copy" -> "draft:k=4")."""
    return ":".join(x for x in label.split(":") if not x.startswith(key + "="))


def _fixed_counterpart(label: str) -> str | None:
    """"draft:k=4:policy=goodput" -> "draft:k=4" (the same config, every proposal verified); an A/A
    copy ("draft:k=4:copy=2", bench's `copy=N`) -> its original, judged as a load-aware policy is
    (what a policy no better than fixed speculation scores there); None for any other config."""
    base = strip_option(label, "copy")
    parts = base.split(":")
    policy = [x for x in parts if x.startswith("policy=")]
    if policy and policy[0] != "policy=fixed":
        return strip_option(base, "policy")
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
            orig = strip_option(c, "copy")
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
        what = " (an A/A copy, judged as a policy: what one no better than it scores)" if base == strip_option(c, "copy") else ""
        lines.append(f"`{c}` against the better of `none` and `{base}`{what}: within {tolerance:.0%} at {ok} of "
                     f"{len(pts)} points; geometric mean {_geomean(r for _, _, r in pts):.3f}; "
                     f"lowest {low[2]:.2f} ({low[0]} {low[1]}).")
    controls = control_points(results)
    if controls:  # the machine's noise in one cell's ratio, from the A/A copies
        sd = aa_noise(controls)
        floor = (1.0 - tolerance) * math.exp(-2 * sd)
        for c, pts in points.items():
            if strip_option(c, "copy") != c:
                continue
            far = [f"{w} {lv} {r:.2f}" for w, lv, r in pts if r < floor]
            lines.append(f"`{c}` more than {tolerance:.0%} below max(none, fixed) by more than twice the A/A "
                         f"noise (sd {sd:.3f} of log(copy / original): below {floor:.2f}): {len(far)} of "
                         f"{len(pts)} points" + (f" ({', '.join(far)})" if far else "") + ".")
    for c, pts in controls.items():
        ok = sum(abs(r - 1.0) <= tolerance for _, _, r in pts)
        below = sum(r < 1.0 - tolerance for _, _, r in pts)
        low, high = min(pts, key=lambda x: x[2]), max(pts, key=lambda x: x[2])
        lines.append(f"A/A control `{c}` against `{strip_option(c, 'copy')}` (the same config, its own engine): within "
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
        rows.append(f"| {c} | " + " | ".join(fmt_cell(row.get(lv), "{:.2f}") for lv in levels) + " |")
    return "\n".join(rows)
