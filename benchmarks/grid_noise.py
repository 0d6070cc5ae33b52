"""How much of a lab grid's spread is the machine's: reads a `draftwise bench` results.json with
`--repeats N` (and, ideally, an A/A copy `X:copy=2` and per-round steal, both recorded since
session 24) and prints

- per A/A copy, the sd of log(copy / original) over the points (two cells of one config);
- the correlation of each round's output tok/s (over its cell's median) with the share of CPU
  time the hypervisor took during it (steal);
- per load-aware config, goodput / max(none, its fixed counterpart) from the median rounds (the
  report's figure), and the same from each config's rounds whose steal stayed under `--max-steal`
  (where a config has any): what the figure would be on a quieter machine, not a substitute.

    .venv/bin/python benchmarks/grid_noise.py benchmarks/lab/cpu32/results.json [--max-steal 0.02]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--max-steal", type=float, default=0.02)
    ap.add_argument("--tolerance", type=float, default=0.03)
    args = ap.parse_args()
    from draftwise.lab.report import _fixed_counterpart, _geomean, _strip, aa_noise, control_points, policy_points

    res = json.load(open(args.results))
    rel, stolen, pol_quiet = [], [], {}

    def quiet(r):  # median tok/s of a run's rounds under the steal limit, or None
        t = (r.get("rounds") or {}).get("output_tokens_per_s") or []
        s = (r.get("rounds") or {}).get("steal_share") or []
        q = [x for x, y in zip(t, s) if y is not None and y <= args.max_steal]
        return statistics.median(q) if q else None

    for wl in res["workloads"]:
        runs = {(r["config"], r["level_label"]): r for r in wl["runs"]}
        for (c, lv), r in runs.items():
            rounds = r.get("rounds") or {}
            tps, st = rounds.get("output_tokens_per_s") or [], rounds.get("steal_share") or []
            med = statistics.median(tps) if tps else None
            for x, s in zip(tps, st):
                if s is not None and med:
                    rel.append(x / med)
                    stolen.append(s)
            base = _fixed_counterpart(c)
            if base is None or _strip(c, "copy") != c or (base, lv) not in runs or ("none", lv) not in runs:
                continue
            mine, n, f = quiet(r), quiet(runs[("none", lv)]), quiet(runs[(base, lv)])
            if mine and n and f:
                pol_quiet.setdefault(c, []).append(mine / max(n, f))
    controls = control_points(res)
    for c, pts in controls.items():
        logs = [math.log(x) for _, _, x in pts]
        print(f"A/A {c}: sd of log(copy / original) {aa_noise({c: pts}):.3f} over {len(pts)} points; "
              f"mean {statistics.mean(logs):+.3f}")
    if stolen:
        r = statistics.correlation(stolen, rel) if len(stolen) > 2 and statistics.pstdev(stolen) > 0 else float("nan")
        print(f"rounds: {len(stolen)}; steal median {statistics.median(stolen):.1%}, max {max(stolen):.1%}; "
              f"correlation of steal with a round's tok/s over its cell's median: {r:+.2f}")
        for lo, hi in ((0, 0.02), (0.02, 0.05), (0.05, 0.1), (0.1, 1.0)):
            xs = [x for x, s in zip(rel, stolen) if lo <= s < hi]
            if xs:
                print(f"  steal {lo:.0%}-{hi:.0%}: {len(xs)} rounds, tok/s over the cell's median: mean "
                      f"{statistics.mean(xs):.3f}, sd {statistics.pstdev(xs):.3f}")
    for c, pts in policy_points(res).items():
        if _strip(c, "copy") != c:
            continue
        pts = [x for _, _, x in pts]
        ok = sum(x >= 1 - args.tolerance for x in pts)
        print(f"{c}: median rounds: {ok} of {len(pts)} within {args.tolerance:.0%}, geomean {_geomean(pts):.3f}")
        q = pol_quiet.get(c)
        if q:
            ok = sum(x >= 1 - args.tolerance for x in q)
            print(f"  rounds with steal <= {args.max_steal:.0%} only: {ok} of {len(q)} points within "
                  f"{args.tolerance:.0%}, geomean {_geomean(q):.3f}")


if __name__ == "__main__":
    main()
