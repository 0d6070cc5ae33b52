"""A/B of how the load-aware policies recover from timings of a cold start: catch-ups or drafting
steps timed slow before the first request.

    .venv/bin/python benchmarks/cold_start_ab.py [--slow catch-up|steps] [--rule default|old]
        [--factor 50] [--times 3] [--policy dspark] [--requests 32] [--rounds 3]

The embedded pair, code-easy, one request at a time (c=1), greedy, 64 tokens each, the draft model
at k=4. Before the first request the policy's planner learns `--times` timings `--factor` times
what it expects:
- `--slow catch-up`: the drafter's catch-ups (its seconds per caught-up token). An overrated
  catch-up stops the plan from restarting a row's drafting, and only a restart times it again;
- `--slow steps`: drafting steps of 4 proposals (the cost model's residual; each followed by a
  plain step at the profile's cost). Once the plan stops drafting, plain steps run several to a
  call and are not observed.
`--rule default` learns as the policies do (`GoodputConfig`: catch-ups in log space, the cost
fit's old steps fading by engine steps); `--rule old` switches the rule in question off
(`catch_up_log`, `cost_fade_by_steps`). Printed per round of `--requests` requests: the steps that
verified proposals among the decode steps, and the time.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.lab.workload import load_workload

CONTEXT = 300.0  # tokens of context the injected steps are timed at


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slow", choices=("catch-up", "steps"), default="catch-up")
    ap.add_argument("--rule", choices=("default", "old"), default="default")
    ap.add_argument("--factor", type=float, default=50.0)
    ap.add_argument("--times", type=int, default=3)
    ap.add_argument("--policy", choices=("dspark", "goodput"), default="dspark")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.factor <= 0 or args.times < 0:
        ap.exit(2, f"cold_start_ab: --factor must be > 0 and --times >= 0, not {args.factor:g} and {args.times}\n")
    reqs = load_workload("code-easy").requests[: args.requests]
    llm = LLM("models/target", draft="models/draft", spec=SpecConfig(method="draft", k=4, policy=args.policy))
    core = llm.engine.speculation.policy.core
    if args.rule == "old":
        field = "catch_up_log" if args.slow == "catch-up" else "cost_fade_by_steps"
        core.config = dataclasses.replace(core.config, **{field: False})
    model, start = core.model, core.catch_up_per_token
    for _ in range(args.times):
        if args.slow == "catch-up":
            core.long_catch_up = 200
            core.learn_catch_up(200 * start * args.factor)
        else:
            for tokens, lengths, factor in ((5, [4], args.factor), (1, [], 1.0)):
                model.observe(1, tokens, CONTEXT, lengths, factor * model.profile_seconds(1, tokens, CONTEXT, lengths))
    core.long_catch_up = 0
    print(f"{args.policy}, rule {args.rule}: {args.times} {args.slow} timings {args.factor:g}x slow")
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    t0 = time.perf_counter()
    for rnd in range(args.rounds):
        for r in reqs:
            llm.generate([r.prompt], sp)
        s = llm.engine.stats
        print(f"  round {rnd}: steps verifying proposals {s.speculative_steps} of {s.decode_steps}; "
              f"catch-up estimate {core.catch_up_per_token / start:.2f}x its start")
    print(f"  {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
