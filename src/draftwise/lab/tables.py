"""The per-workload tables of a bench report, as Markdown: the run table, acceptance, steal,
capacity, the distribution test, structured output's validity and the speedup matrix.

Each function takes one workload entry of `results.json` (`results.py`) and returns its table,
or "" when the workload has nothing for it.
"""
from __future__ import annotations


def fmt_cell(x, fmt="{:.1f}") -> str:
    """A table cell: `x` formatted, or an en dash where there is no figure."""
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
        mem_cell = fmt_cell(mem, "{:.0f}") + ("" if not rec else f" (recurrent: {rec['state_kib_per_seq']:.0f} KiB/seq, "
                                                          f"scratch {rec['scratch_peak_kib']:.0f} KiB)")
        rows.append(
            f"| {r['config']} | {r['level_label']} | {fmt_cell(r['output_tokens_per_s'])} | {fmt_cell(r['requests_per_s'], '{:.2f}')} "
            f"| {fmt_cell(r['goodput_requests_per_s'], '{:.2f}')} "
            f"| {fmt_cell(r['ttft_ms']['p50'], '{:.0f}')} / {fmt_cell(r['ttft_ms']['p99'], '{:.0f}')} "
            f"| {fmt_cell(r['itl_ms']['p50'])} / {fmt_cell(r['itl_ms']['p99'])} "
            f"| {fmt_cell(r['tpot_ms']['p50'])} / {fmt_cell(r['tpot_ms']['p99'])} "
            f"| {fmt_cell(r['e2e_ms']['p50'], '{:.0f}')} / {fmt_cell(r['e2e_ms']['p99'], '{:.0f}')} "
            f"| {fmt_cell(sp.get('mean_accepted_length'), '{:.2f}')} | {split} | {gram} | {mem_cell} "
            f"| {fmt_cell(sp.get('prefix_cache_hit_rate'), '{:.0%}')} "
            f"| {fmt_cell(r.get('cost_per_million_output_tokens'), '{:.2f}')} "
            f"| {fmt_cell(vs.get('speedup'), '{:.2f}x')} | {fmt_cell(vs.get('goodput_ratio'), '{:.2f}x')} | {mism} |")
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
    rows = ["| config | level | rounds | acceptance rate | acceptance by position | conditional, by position "
            "| confidence ECE | committed per round (tokens: rounds) "
            "| verified per round (proposals: rounds) | rounds / steps speculating "
            "| step time measured / predicted, median (profile alone) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in wl["runs"]:
        sp = r.get("speculation") or {}
        if not sp or not sp.get("proposed_tokens"):
            continue
        pos = " ".join(f"{a:.2f}" for a in sp["acceptance_by_position"])
        cond = " ".join(fmt_cell(a, "{:.2f}") for a in sp.get("conditional_acceptance_by_position") or [])
        rel = sp.get("confidence_reliability")
        ece = f"{rel['ece']:.3f} ({rel['positions']})" if rel else "–"
        hist = " ".join(f"{k}:{v}" for k, v in sp["committed_per_round"].items())
        vhist = " ".join(f"{k}:{v}" for k, v in (sp.get("verified_per_round") or {}).items())
        share = f"{fmt_cell(sp.get('rounds_speculating'), '{:.0%}')} / {fmt_cell(sp.get('steps_speculating'), '{:.0%}')}"
        pred = sp.get("step_time_measured_over_predicted") or {}
        rows.append(f"| {r['config']} | {r['level_label']} | {sp['rounds']} | {fmt_cell(sp['acceptance_rate'], '{:.2f}')} "
                    f"| {pos} | {cond or '–'} | {ece} | {hist} | {vhist} | {share} | {fmt_cell(pred.get('median'), '{:.2f}')} "
                    f"({fmt_cell(pred.get('median_profile_only'), '{:.2f}')}) |")
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
        rows.append(f"| {label} | {c['requests_per_s']:.3g} | {fmt_cell(ratio, '{:.2f}x')} "
                    f"| {fmt_cell(c['first_failing_rate'], '{:.3g}')} | {probes} |")
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
    """Rows = speculative configs, columns = levels: output tok/s speedup over `none` (with
    `bench --url --reference-url`: over the reference server, which plays `none`'s part)."""
    def is_base(r: dict) -> bool:
        return r["config"] == "none" or r.get("method") == "reference"

    levels = list(dict.fromkeys(r["level_label"] for r in wl["runs"]))
    configs = [c for c in dict.fromkeys(r["config"] for r in wl["runs"] if not is_base(r))]
    if not configs:
        return ""
    base = {r["level_label"]: r["output_tokens_per_s"] for r in wl["runs"] if is_base(r)}
    if not base:  # nothing to compare with (`bench --url` without --reference-url): the rates themselves
        rate = {(r["config"], r["level_label"]): r["output_tokens_per_s"] for r in wl["runs"]}
        return "\n".join(["| out tok/s | " + " | ".join(levels) + " |", "|---|" + "---|" * len(levels)] + [
            f"| {c} | " + " | ".join(fmt_cell(rate.get((c, lv))) for lv in levels) + " |" for c in configs])
    cell = {(r["config"], r["level_label"]): (r.get("vs_none") or {}).get("speedup") for r in wl["runs"]}
    name = next((r["config"] for r in wl["runs"] if is_base(r)), "none")
    rows = [f"| speedup vs {name} | " + " | ".join(levels) + " |", "|---|" + "---|" * len(levels),
            f"| {name} (out tok/s) | " + " | ".join(fmt_cell(base.get(lv)) for lv in levels) + " |"]
    for c in configs:
        rows.append(f"| {c} | " + " | ".join(
            ("**" + fmt_cell(cell.get((c, lv)), "{:.2f}x") + "**") if (cell.get((c, lv)) or 0) >= 1.05
            else fmt_cell(cell.get((c, lv)), "{:.2f}x") for lv in levels) + " |")
    return "\n".join(rows)
