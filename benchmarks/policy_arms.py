"""The goodput policy's arms at one load point, in one process: which arm ran at which batch size,
its steps' rate, and what its steps cost against plain steps at the same batch size.

    .venv/bin/python benchmarks/policy_arms.py WORKLOAD CONCURRENCY[,CONCURRENCY...] [--rounds 3] [--num-requests 64]
        [--configs none,draft:k=4,draft:k=4:policy=goodput] [--output-len 128] [--threads 2]
        [--rate R] [--max-tokens N] [--force ARM] [--plan-edge X] [--time-slice MS] [--trace]

Runs the lab's in-process bench (`run_bench`: one engine per config, built once, the configs'
rounds alternated) at one concurrency level and prints, per config, the median round's output
tok/s, its ratio to `none`, every round, and the engine time per token (drafting + verification +
scheduling/state). Then, for the goodput engines, per (batch bucket, arm): steps, committed tokens
per second over the steps' measured seconds (decode steps; mixed prefill steps are not timed
apart), and the excess of those seconds over what plain steps at that bucket took for the same
tokens: where exploring and switching cost.

`--force ARM` makes the measured check always choose ARM ("plain", "full" or "spec", coasting
off): the arm's own cost beside the config it stands for. `--rate R`: open-loop arrivals at R
requests/s (CONCURRENCY then unused), as the capacity search probes them. `--plan-edge X` sets `_Arms.PLAN_EDGE`.
One run on a shared 2-vCPU machine moves by up to ~25% from the next: compare within a run, best
with `--time-slice 50` (the configs' rounds together, each timed by its own slices).
"""
from __future__ import annotations

import argparse
import collections
import time

import torch
from rich.console import Console


def _levels(text: str) -> list[int]:
    """CONCURRENCY[,CONCURRENCY...] -> the levels (argparse reports a bad one in one line, exit 2)."""
    levels = [int(c) for c in text.split(",")]  # (ValueError: argparse's "invalid _levels value")
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be positive integers, got {text!r}")
    return levels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload")
    ap.add_argument("concurrency", type=_levels, help="a level, or levels run in turn through the same engines (1,2,4,8:"
                    " as the grid reaches 8; the step figures and trace are of them all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--configs", default="none,draft:k=4,draft:k=4:policy=goodput")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rate", type=float, help="open-loop arrivals at this mean requests/s instead of CONCURRENCY")
    ap.add_argument("--max-tokens", type=int, help="cap per request instead of --output-len")
    ap.add_argument("--force", choices=("plain", "full", "spec"))
    ap.add_argument("--plan-edge", type=float)
    ap.add_argument("--trace", action="store_true", help="print each goodput engine's steps as runs of (bucket, arm)")
    ap.add_argument("--time-slice", type=float, metavar="MS",
                    help="run each round's configs together, MS each in turn (lab/timeslice.py)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from draftwise.lab.arrivals import LoadLevel
    from draftwise.lab.runner import BenchPlan, parse_configs, run_bench
    from draftwise.lab.workload import load_workload
    from draftwise.policies import goodput as gp

    if args.plan_edge is not None:
        gp._Arms.PLAN_EDGE = args.plan_edge
    if args.force:
        gp._Arms.choose = lambda self, pred, credit=0.0, cap=0.0, last=None: args.force
        gp._Arms.coast = lambda self, *a, **k: None

    steps, seconds, tokens = collections.Counter(), collections.Counter(), collections.Counter()
    trace = {} if args.trace else None
    switches = collections.Counter()  # bucket -> steps on the other side (drafting or not) than the step before
    observe_step = gp.GoodputPolicy.observe_step

    def tally(self, num_seqs, num_tokens, context, draft_lengths, secs, catch_up_seconds=0.0, **kw):
        key = (gp.batch_bucket(num_seqs), self._mode)
        steps[key] += 1
        switches[key[0]] += (self._mode == "plain") != (self._last_mode == "plain")  # sides: drafting or not
        if trace is not None:  # run lengths of (bucket, arm), per engine
            runs = trace.setdefault(id(self), [])
            if runs and runs[-1][0] == key:
                runs[-1][1] += 1
            else:
                runs.append([key, 1])
        if secs is not None:
            seconds[key] += secs
            tokens[key] += self._committed[0] + max(0, num_seqs - self._committed[1])
        return observe_step(self, num_seqs, num_tokens, context, draft_lengths, secs, catch_up_seconds, **kw)

    gp.GoodputPolicy.observe_step = tally
    py = collections.Counter()  # the policy's own Python: plan and admit seconds, steps planned
    plan_fn = gp.GoodputPolicy.plan

    def timed_plan(self, seqs, max_draft):
        t0 = time.perf_counter()
        out = plan_fn(self, seqs, max_draft)
        py["plan"] += time.perf_counter() - t0
        py["planned"] += self._pred is not None
        py["calls"] += 1
        return out

    def timed(name):  # the method `name` of the policy, its time added to py[name]
        fn = getattr(gp.GoodputPolicy, name)

        def wrapper(self, *a, **k):
            t0 = time.perf_counter()
            out = fn(self, *a, **k)
            py[name] += time.perf_counter() - t0
            return out
        return wrapper

    gp.GoodputPolicy.plan = timed_plan
    for name in ("admit", "observe", "observe_step"):
        setattr(gp.GoodputPolicy, name, timed(name))
    plan = BenchPlan(workloads=[load_workload(args.workload).head(args.num_requests)],
                     configs=parse_configs(args.configs),
                     levels=[LoadLevel("rate", args.rate)] if args.rate else
                     [LoadLevel("concurrency", c) for c in args.concurrency],
                     output_len=None if args.max_tokens else args.output_len, max_tokens=args.max_tokens,
                     repeats=args.rounds, time_slice=args.time_slice / 1000 if args.time_slice else None)
    t = time.perf_counter()
    runs = run_bench(plan, Console(stderr=True, quiet=True))[0]["runs"]
    for r in runs:
        base = next((x["output_tokens_per_s"] for x in runs
                     if x["config"] == "none" and x["level_label"] == r["level_label"]), None)
        m = r["speculation"]["ms_per_token"]
        ratio = f"{r['output_tokens_per_s'] / base:.3f}x none" if base else ""
        rounds = [round(x) for x in r.get("rounds", {}).get("output_tokens_per_s", [])]
        print(f"{r['level_label']:5s} {r['config']:28s} {r['output_tokens_per_s']:8.1f} tok/s {ratio} rounds {rounds} ms/token "
              f"{m['drafting']:.3f}+{m['verification']:.3f}+{m['scheduling_state']:.3f} = {m['total']:.3f}"
              f"; TPOT p90 {r['tpot_ms']['p90']:.2f} ms")
    total = 0.0
    for key in sorted(steps):
        plain = (key[0], "plain")
        rate = tokens[plain] / seconds[plain] if seconds[plain] else None
        excess = seconds[key] - tokens[key] / rate if rate and seconds[key] else 0.0
        total += excess
        own = f"{tokens[key] / seconds[key]:.0f} tok/s" if seconds[key] else "-"
        print(f"bucket {key[0]:2d} {key[1]:5s} {steps[key]:5d} steps {own:>11s}"
              + (f"  excess over plain {excess * 1000:.0f} ms" if rate else ""))
    for runs in (trace or {}).values():
        print("trace: " + " ".join(f"{b}:{a}x{n}" for (b, a), n in runs))
    print("switches between drafting and plain steps per bucket: "
          + ", ".join(f"{b}: {n}" for b, n in sorted(switches.items()) if n))
    print(f"excess over plain, all buckets: {total * 1000:.0f} ms; {time.perf_counter() - t:.0f} s")
    step_seconds = sum(seconds.values())
    print(f"policy's own Python: plan {py['plan'] * 1000:.0f} ms ({py['planned']} of {py['calls']} calls planned), "
          f"admit {py['admit'] * 1000:.0f} ms, observe {py['observe'] * 1000:.0f} ms, observe_step "
          f"{py['observe_step'] * 1000:.0f} ms ({py['calls']} steps); timed decode steps {step_seconds * 1000:.0f} ms")


if __name__ == "__main__":
    main()
