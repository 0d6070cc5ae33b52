"""How a drafter's proposals fare position by position, from an `EngineStats` delta (chain rounds):

- conditional acceptance by position: P(proposal j accepted | proposals 1..j-1 accepted and j
  verified), DSpark's Figure 2 quantity; the unconditional `acceptance_by_position` mixes it with
  how often position j is reached at all;
- the reliability of the drafter's per-position confidence (max q for a draft model, the confidence
  head's c_j for DSpark, a match-length score for lookup drafters) as a predictor of that
  conditional acceptance: per bin the mean confidence against the accepted share, and the expected
  calibration error ECE = sum_b (n_b / n) |mean confidence_b - acceptance_b|.

Both take raw counts, so runs can be pooled by adding their counts before the ratio.
"""
from __future__ import annotations


def conditional_acceptance(reached: list[int], passed: list[int]) -> list[float | None]:
    """passed[j] / reached[j] per position (None where position j was never reached)."""
    return [p / r if r else None for r, p in zip(reached, passed)]


def reliability(reached: dict, passed: dict, conf_sum: dict) -> dict | None:
    """{"bins": [[mean confidence, accepted share, positions], ...] in bin order, "ece", "positions"}
    from per-bin counts (keys may be ints or their strings, as JSON gives them back); None without data."""
    def as_int(d: dict) -> dict:
        return {int(k): v for k, v in (d or {}).items()}

    reached, passed, conf_sum = as_int(reached), as_int(passed), as_int(conf_sum)
    n = sum(reached.values())
    if not n:
        return None
    bins, ece = [], 0.0
    for b in sorted(k for k, v in reached.items() if v):
        m = reached[b]
        conf, acc = conf_sum.get(b, 0.0) / m, passed.get(b, 0) / m
        bins.append([conf, acc, m])
        ece += m / n * abs(conf - acc)
    return {"bins": bins, "ece": ece, "positions": n}


def pooled(runs: list[dict]) -> dict:
    """The raw counts of several runs' `speculation` figures added: {"reached", "passed",
    "confidence": {"reached", "passed", "sum"}} (runs without them add nothing)."""
    reached: list[int] = []
    passed: list[int] = []
    conf = {"reached": {}, "passed": {}, "sum": {}}
    for sp in runs:
        counts = (sp or {}).get("position_counts") or {}
        for total, part in ((reached, counts.get("reached") or []), (passed, counts.get("passed") or [])):
            total.extend([0] * (len(part) - len(total)))
            for j, v in enumerate(part):
                total[j] += v
        for key in conf:
            for b, v in (counts.get("confidence", {}).get(key) or {}).items():
                conf[key][int(b)] = conf[key].get(int(b), 0) + v
    return {"reached": reached, "passed": passed, "confidence": conf}
