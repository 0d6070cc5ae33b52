"""The goodput policy's measured check (`_Arms`) driven by synthetic steps on a drifting machine.

    .venv/bin/python benchmarks/arms_sim.py [--seeds 40] [--steps 4000] [--drift-sigma 0.08]
        [--drift-tau 1500] [--noise 0.05] [--lag-cost 0.05] [--max-lag 128]

Each scenario gives the three arms a true cost (rows, seconds a step) and fixed speculation's
acceptance; every step the machine's speed is exp(x), x an Ornstein-Uhlenbeck process (stationary
sd `--drift-sigma`, correlation time `--drift-tau` steps: on the AVX-512 EPYC a fixed matmul drifts
0.88-1.09x its median within a minute, benchmarks/machine_noise.py), times lognormal step noise.
A drafting step commits, per row, 1 + the proposals accepted (one uniform draw against the
scenario's cumulative acceptance by position: code-hard's 0.71 0.52 0.38 0.27); a drafting step
right after plain ones pays a catch-up (half a plain step) and is a switch, as in the engine.
The check sees what the policy sees (the model's expectations, the measured seconds and tokens)
and chooses every step; the run's committed tokens per second are reported over the best arm's
under the same drift and noise (1.0: an oracle), mean and worst tenth over `--seeds` runs.

Rows: the check as it is (`_Arms`), and the rule before tokens were rated over many steps
(`--rule burst-tokens`: tokens per step measured over the arm's last ~10 steps, as its seconds).
A model of the check, not of the engine: the plan's Python, the drafter's real catch-ups and the
"spec" arm's own lengths are not in it.
"""
from __future__ import annotations

import argparse
import math
import random

from draftwise.policies.goodput import GoodputPolicy, _Arms

CODE_HARD = (0.71, 0.52, 0.38, 0.27)  # P(accepted length >= j), fixed speculation at k=4
# name: rows, seconds a step per arm (plain, full, spec), the model's seconds per arm; "spec"
# commits 0.87 of "full"'s tokens
SCENARIOS = {
    "full 20% ahead": (2, (2.86e-3, 6.9e-3, 6.6e-3), (2.9e-3, 6.0e-3, 5.5e-3)),
    "full 5% ahead": (8, (6.0e-3, 16.4e-3, 15.0e-3), (6.0e-3, 14e-3, 13e-3)),
    "tie": (16, (9.5e-3, 27.3e-3, 25e-3), (9.0e-3, 25e-3, 22e-3)),
    "plain 5% ahead": (8, (6.0e-3, 18.1e-3, 16e-3), (6.0e-3, 14e-3, 13e-3)),
    "plain 13% ahead": (16, (9.5e-3, 31e-3, 29e-3), (9.0e-3, 25e-3, 22e-3)),
}
SPEC_SHARE = 0.87


class BurstTokens(_Arms):
    """The rule before: an arm's tokens per step measured over its last ~10 steps."""

    def rating(self, arm, pred):
        tok_m, _, sec_m, _, n = self.figures[arm]
        if arm in self.own and sec_m > 0:
            return (tok_m / n) / max(sec_m / n + pred[2], 1e-12)
        return super().rating(arm, pred)


def run(arms_cls, rows: int, true_s, model_s, seed: int, steps: int, sigma: float, tau: float,
        noise: float, lag_cost: float = 0.0, max_lag: int = 128) -> float:
    rng = random.Random(seed)
    arms = arms_cls(GoodputPolicy.ARMS)
    per_row = 1 + sum(CODE_HARD)
    expected = {"plain": rows, "full": rows * per_row, "spec": rows * per_row * SPEC_SHARE}
    true = dict(zip(("plain", "full", "spec"), true_s))
    model = dict(zip(("plain", "full", "spec"), model_s))
    credit, cap, last, x = 0.0, GoodputPolicy.CREDIT_CAP, "plain", 0.0
    lag = 0  # plain steps since the last drafting one (the drafter's catch-up grows with it)
    got = [0.0, 0.0]
    oracle = {a: [0.0, 0.0] for a in true}
    for _ in range(steps):
        x += -x / tau + sigma * math.sqrt(2 / tau) * rng.gauss(0, 1)
        speed = math.exp(x) * math.exp(noise * rng.gauss(0, 1))
        mode = arms.coast(credit, cap)
        if mode is None:
            catch = lag_cost * true["plain"] * lag / GoodputPolicy.CATCH_UP_HORIZON  # amortised, as `plan` does
            mode = arms.choose({a: (expected[a], model[a], catch if a != "plain" else 0.0) for a in true},
                               credit, cap, last=last)
        exploring, lead = arms.exploring, arms.lead_rate
        tokens = float(rows)
        if mode != "plain":
            tokens = sum(1 + sum(u < a for a in CODE_HARD) for u in (rng.random() for _ in range(rows)))
            tokens *= SPEC_SHARE if mode == "spec" else 1.0
        seconds = true[mode] * speed
        switched = (mode != "plain") != (last != "plain")
        if mode != "plain" and last == "plain":
            # the drafter's catch-up: half a plain step, or `lag_cost` of one per plain step missed
            # (up to `max_lag`: a request's output)
            seconds += (lag_cost * lag if lag_cost else 0.5) * true["plain"] * speed
        lag = min(max_lag, lag + 1) if mode == "plain" else 0  # (requests end: their lag with them)
        got[0] += tokens
        got[1] += seconds
        for a in true:
            oracle[a][0] += expected[a]
            oracle[a][1] += true[a] * speed
        credit = min(cap, credit + GoodputPolicy.EXPLORE_BUDGET * seconds)
        if exploring is not None and 0 < lead < math.inf:
            cost = seconds - tokens / lead
            credit -= cost
            arms.spend(exploring, cost)
        arms.record(mode, tokens, expected[mode], seconds, model[mode], switched=switched)
        last = mode
    return (got[0] / got[1]) / max(t / s for t, s in oracle.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--drift-sigma", type=float, default=0.08)
    ap.add_argument("--drift-tau", type=float, default=1500.0)
    ap.add_argument("--noise", type=float, default=0.05)
    ap.add_argument("--lag-cost", type=float, default=0.0,
                    help="the catch-up grows by this share of a plain step per plain step missed (0: half a step)")
    ap.add_argument("--max-lag", type=int, default=128, help="plain steps missed that the catch-up counts at most")
    args = ap.parse_args()
    print(f"rate over the best arm's, mean / worst tenth of {args.seeds} runs of {args.steps} steps "
          f"(drift sd {args.drift_sigma}, {args.drift_tau:g} steps; step noise {args.noise})")
    print(f"{'scenario':18s} {'_Arms':>13s} {'burst-tokens':>13s}")
    for name, (rows, true_s, model_s) in SCENARIOS.items():
        cells = []
        for cls in (_Arms, BurstTokens):
            r = sorted(run(cls, rows, true_s, model_s, s, args.steps, args.drift_sigma, args.drift_tau, args.noise,
                           args.lag_cost, args.max_lag)
                       for s in range(args.seeds))
            cells.append(f"{sum(r) / len(r):.3f} / {r[len(r) // 10]:.3f}")
        print(f"{name:18s} " + " ".join(f"{c:>13s}" for c in cells))


if __name__ == "__main__":
    main()
