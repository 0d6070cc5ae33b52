"""The verification policies on a simulated clock: no engine, no model, no machine noise.

    .venv/bin/python benchmarks/policy_sim.py [--profile benchmarks/lab/profile-cpu.json]
        [--concurrency 1,2,4,8,16,32] [--requests 24] [--output-len 128] [--seeds 3]
        [--acceptance 0.7] [--spread 0.15] [--noise 0.08]

A closed loop of `--concurrency` requests (a finished one is replaced at once). Each request has
its own acceptance rate (drawn around `--acceptance` with `--spread`), drifting a little from step
to step; a proposal's confidence is that rate plus noise, and it is accepted with that rate (given
the earlier ones were). A step costs what the hardware profile says for B rows and T tokens fed
(target) and for the drafter's steps, plus the drafter's catch-up (tokens it has not seen, at a
fifteenth of a target token each: a new prompt, or steps without drafting), plus 0.2 ms + 0.02 ms
per row of Python work, times lognormal noise (`--noise`). The policies are the engine's own
classes (`fixed`, `goodput`) fed what the engine would feed them; `none` never drafts.

What it is for: the goodput policy's measured check (bursts, intervals, buckets) against the best
fixed choice at each load, with the machine's noise taken out (the lab's ratios move by +-5-10%
between runs on the shared 2-core machine). It does not model the engine's real costs beyond the
profile (e.g. oneDNN's per-shape behaviour), so its figures are no substitute for `draftwise bench`.
"""
from __future__ import annotations

import argparse
import math
import random
from types import SimpleNamespace

from draftwise.policies import policy_class
from draftwise.policies.profile import HardwareProfile
from draftwise.proposers import DraftBlock
from draftwise.sampling import SamplingParams

PROMPT = 250  # tokens per prompt (the drafter's catch-up for a new request)
K = 4


def simulate(policy: str, c: int, cost, *, requests: int, output_len: int, acceptance: float, spread: float,
             noise: float, seed: int) -> float:
    rng = random.Random(seed)
    pol = None if policy == "none" else policy_class(policy)(k=K, cost=cost, has_draft_model=True)
    greedy = SamplingParams(temperature=0)
    next_id, started = 0, 0
    rows: list[SimpleNamespace] = []

    def new_row():
        nonlocal next_id, started
        a = min(0.95, max(0.05, rng.gauss(acceptance, spread)))
        r = SimpleNamespace(seq_id=next_id, params=greedy, num_tokens=PROMPT, out=0, a=a, behind=PROMPT,
                            draft_computed=0)
        next_id += 1
        started += 1
        return r

    rows = [new_row() for _ in range(min(c, requests))]
    clock, tokens = 0.0, 0
    while rows:
        b = len(rows)
        ctx = sum(r.num_tokens for r in rows) / b
        max_draft = [max(0, min(K, output_len - r.out - 1)) for r in rows]
        lengths = [0] * b if pol is None else pol.plan(rows, max_draft)
        blocks = []
        for r, n in zip(rows, lengths):
            r.a = min(0.95, max(0.05, r.a + rng.gauss(0.0, 0.02)))  # a slow drift
            blocks.append(DraftBlock([1] * n, None, [min(1.0, max(0.0, r.a + rng.gauss(0.0, 0.1))) for _ in range(n)]))
        admitted = [0] * b if pol is None else pol.admit(rows, blocks, 0.0)
        drafting = [r for r, n in zip(rows, lengths) if n]
        per_token = cost.target[2] / 15
        # a row more than 32 behind feeds all but its last token in forwards of their own (timed
        # apart, as the engine does), a shorter lag in the first drafter step
        long_s = sum(r.behind - 1 for r in drafting if r.behind > 32) * per_token
        short_s = sum(r.behind - 1 for r in drafting if r.behind <= 32) * per_token
        draft_s = sum(cost.draft_seconds(sum(n > j for n in lengths), ctx) for j in range(max(lengths, default=0)))
        catch_up_s = long_s
        fed = b + sum(admitted)
        seconds = (cost.target_seconds(b, fed, ctx) + draft_s + long_s + short_s + 0.0002 + 0.00002 * b)
        seconds *= math.exp(rng.gauss(0.0, noise))
        clock += seconds
        done = []
        for r, blk, n in zip(rows, blocks, admitted):
            acc = 0
            while acc < n and rng.random() < r.a:
                acc += 1
            committed = min(acc + 1, output_len - r.out)
            r.out += committed
            r.num_tokens += committed
            tokens += committed
            r.behind = 1 if blk.token_ids else r.behind + committed  # the drafter saw the round's tokens
            r.draft_computed = r.num_tokens - r.behind
            if pol is not None:
                pol.observe(r, blk, n, acc)
            if r.out >= output_len:
                done.append(r)
        if pol is not None:
            pol.observe_step(b, fed, ctx, list(lengths), seconds, catch_up_seconds=catch_up_s)
        for r in done:
            rows.remove(r)
            if pol is not None:
                pol.forget(r.seq_id)
            if started < requests:
                rows.append(new_row())
    return tokens / clock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="benchmarks/lab/profile-cpu.json")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--acceptance", type=float, default=0.7)
    ap.add_argument("--spread", type=float, default=0.15)
    ap.add_argument("--noise", type=float, default=0.08)
    args = ap.parse_args()
    cost = HardwareProfile.load(args.profile).grid_cost()
    print(f"acceptance {args.acceptance} +- {args.spread}, {args.requests} requests x {args.output_len} tokens, "
          f"step noise {args.noise}, {args.seeds} seeds; tok/s of the simulated clock, and goodput / best of the two")
    print("| c | none | fixed | goodput | goodput / max(none, fixed) |")
    print("|---|---|---|---|---|")
    for c in (int(x) for x in args.concurrency.split(",")):
        rates = {}
        for policy in ("none", "fixed", "goodput"):
            rates[policy] = sum(simulate(policy, c, cost, requests=args.requests, output_len=args.output_len,
                                         acceptance=args.acceptance, spread=args.spread, noise=args.noise, seed=s)
                                for s in range(args.seeds)) / args.seeds
        best = max(rates["none"], rates["fixed"])
        print(f"| {c} | {rates['none']:.0f} | {rates['fixed']:.0f} | {rates['goodput']:.0f} | "
              f"{rates['goodput'] / best:.3f} |")


if __name__ == "__main__":
    main()
