"""A/B of how the load-aware policies learn the drafter's catch-up cost, after catch-ups timed slow.

    .venv/bin/python benchmarks/catch_up_ab.py [--rule log|step] [--slow 50] [--times 3]
        [--policy dspark] [--requests 32] [--rounds 3]

The embedded pair, code-easy, one request at a time (c=1), greedy, 64 tokens each. Before the
first request the policy's planner learns `--times` catch-ups timed `--slow` times its starting
estimate (what a cold first round can time), with `--rule log` (the policies' default: a step in
log space) or `--rule step` (`GoodputConfig.catch_up_log` off: a step in seconds). Printed per
round of `--requests` requests: the estimate against its start, and the steps that verified
proposals among the decode steps. An overrated catch-up stops the plan from restarting a row's drafting,
and only a restart times it again.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from draftwise import LLM, SamplingParams, SpecConfig

WORKLOAD = Path(__file__).resolve().parent.parent / "src" / "draftwise" / "workloads" / "code-easy.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rule", choices=("log", "step"), default="log")
    ap.add_argument("--slow", type=float, default=50.0)
    ap.add_argument("--times", type=int, default=3)
    ap.add_argument("--policy", choices=("dspark", "goodput"), default="dspark")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    reqs = [json.loads(line) for line in WORKLOAD.read_text().splitlines() if line.strip()][: args.requests]
    llm = LLM("models/target", draft="models/draft", spec=SpecConfig(method="draft", k=4, policy=args.policy))
    core = llm.engine.speculation.policy.core
    core.config = dataclasses.replace(core.config, catch_up_log=args.rule == "log")
    start = core.catch_up_per_token
    for _ in range(args.times):
        core.long_catch_up = 200
        core.learn_catch_up(200 * start * args.slow)
    core.long_catch_up = 0
    print(f"rule {args.rule}: after {args.times} catch-ups timed {args.slow:g}x, the estimate is "
          f"{core.catch_up_per_token / start:.2f}x its start")
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    t0 = time.perf_counter()
    for rnd in range(args.rounds):
        for r in reqs:
            llm.generate([r["prompt"]], sp)
        s = llm.engine.stats
        print(f"  round {rnd}: estimate {core.catch_up_per_token / start:.2f}x, steps verifying proposals "
              f"{s.speculative_steps} of {s.decode_steps}")
    print(f"  {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
