"""Capacity mode: the highest open-loop request rate at which a latency SLO still holds.

    draftwise bench --find-capacity --slo tpot=50,ttft=1000

For each config the same requests are replayed at Poisson arrival rates chosen by a search:
first doubling from a start rate until the SLO breaks, then bisection between the last rate that
held and the first that broke, until they are within `rel_tol` of each other or `max_probes`
rates were probed. A rate beyond what the engine sustains breaks a TTFT or E2E limit (requests
queue), not a TPOT or ITL one (the running batch is capped): an SLO of TPOT alone may hold at
every rate probed, which the result says (`converged` false, `first_failing_rate` None) and the
report spells out with the rates actually achieved. The SLO holds at a rate when every
request completed and the p90 of each limited metric (TTFT, TPOT, ITL, E2E) is within its limit;
with `--repeats N` a probe runs N times and its median run (`median_probe`) decides.
The answer, "requests/s at the latency limit", is the highest rate that held (0 if none did);
every probe is kept (rate, held, the p90s) so the search can be read back. The configs' searches
advance in lock-step, their runs interleaved (`find_capacities`): ratios side by side in one run.
"""
from __future__ import annotations

from typing import Callable, Generator

SLO_METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2e": "e2e_ms"}


def slo_holds(summary: dict, slo: dict[str, float]) -> bool:
    """Every request completed and each limited metric's p90 (ms) is within its limit."""
    return slo_margin(summary, slo) <= 1.0


def slo_margin(summary: dict, slo: dict[str, float]) -> float:
    """How far a run is from breaking the SLO: the largest p90 / limit over the limited metrics
    (<= 1 holds), infinite when a request did not complete."""
    if summary["completed"] < summary["num_requests"]:
        return float("inf")
    ratios = [(summary.get(SLO_METRICS[k]) or {}).get("p90") for k in slo]
    return max((r / slo[k] for k, r in zip(slo, ratios) if r is not None), default=0.0)


def median_probe(summaries: list[dict], slo: dict[str, float]) -> dict:
    """Of a probe's repeated runs at one rate, the median by `slo_margin` (one noisy run does not
    decide whether the rate held)."""
    return {**sorted(summaries, key=lambda s: slo_margin(s, slo))[len(summaries) // 2], "runs": len(summaries)}


def capacity_search(
    slo: dict[str, float],
    *,
    start_rate: float = 1.0,
    rel_tol: float = 0.1,
    max_probes: int = 8,
) -> Generator[float, dict, dict]:
    """The search as a generator: yields the next rate to probe, is sent that probe's `summarize`
    dict (or `median_probe`'s), returns the result (`find_capacity`'s). Several searches can so
    advance in lock-step, one probe each in turn (`find_capacities`)."""
    if not slo:
        raise ValueError("--find-capacity needs --slo (e.g. tpot=50 or ttft=1000,tpot=50)")
    probes = []

    def record(rate: float, s: dict) -> bool:
        ok = slo_holds(s, slo)
        probes.append({"rate": rate, "held": ok, "runs": s.get("runs", 1),
                       "achieved_requests_per_s": s["requests_per_s"],
                       **{f"{k}_p90_ms": (s.get(SLO_METRICS[k]) or {}).get("p90") for k in slo}})
        return ok

    good, bad, rate = 0.0, None, start_rate
    while len(probes) < max_probes:  # doubling until the SLO breaks
        if record(rate, (yield rate)):
            good, rate = rate, rate * 2
        else:
            bad = rate
            break
    while bad is not None and len(probes) < max_probes and bad - good > rel_tol * max(good, bad / 2):
        mid = (good + bad) / 2 if good else bad / 2
        if record(mid, (yield mid)):
            good = mid
        else:
            bad = mid
    return {"requests_per_s": good, "first_failing_rate": bad, "probes": probes, "slo_ms": dict(slo),
            "converged": bad is not None and bad - good <= rel_tol * max(good, bad / 2)}


def find_capacity(
    measure: Callable[[float], dict],  # rate (requests/s) -> a `summarize` dict of one run at it
    slo: dict[str, float],
    **search,
) -> dict:
    """One config's search, its probes back to back."""
    return find_capacities({"": lambda rate, rnd: measure(rate)}, slo, **search)[""]


def find_capacities(
    measures: dict[str, Callable[[float, int], dict]],  # name -> (rate, round) -> one run's `summarize` dict
    slo: dict[str, float],
    *,
    repeats: int = 1,
    together: Callable[[list[tuple[str, float]], int], dict[str, dict]] | None = None,
    **search,
) -> dict[str, dict]:
    """Every config's search in lock-step, so that a drifting machine weighs on none more than on
    the others (run one after the other, the search that ran last met the machine's slowest
    minutes as often as not): each step, every config still searching probes its next rate,
    `repeats` runs each, the configs' runs interleaved run by run (the order rotated each run)
    and each probe decided by its median run (`median_probe`). `together`, when given, runs one
    such round of runs at once ([(name, rate)] in order, round -> {name: summary}): the runner's
    time-sliced runs."""
    searches = {name: capacity_search(slo, **search) for name in measures}
    rates = {name: next(g) for name, g in searches.items()}
    results: dict[str, dict] = {}
    turn = 0
    while rates:
        runs: dict[str, list[dict]] = {name: [] for name in rates}
        names = list(rates)
        for rnd in range(repeats):
            k = turn % len(names)
            turn += 1
            order = names[k:] + names[:k]
            if together is not None:
                done = together([(name, rates[name]) for name in order], rnd)
                for name in order:
                    runs[name].append(done[name])
                continue
            for name in order:
                runs[name].append(measures[name](rates[name], rnd))
        for name in names:
            try:
                rates[name] = searches[name].send(median_probe(runs[name], slo) if repeats > 1 else runs[name][0])
            except StopIteration as done:
                results[name] = done.value
                del rates[name]
    return {name: results[name] for name in measures}
