"""The drafter's prefix cache, side by side in one process: speculative decoding with and without
it, against plain decoding, on prompts the caches have seen.

    .venv/bin/python benchmarks/draft_prefix_cache.py [--workload code-easy] [--concurrency 32]
        [--rounds 3] [--policies fixed,goodput] [--max-tokens 128] [--threads 2]

Engines on the embedded pair (greedy, draft k=4): `none`; per policy, one with the drafter's
prefix cache (the default) and one with it turned off (`proposer.kv.prefix_cache = None`: the
drafter feeds every prompt from its first token, as before the drafter had a cache; the target
keeps its own cache in every engine). Each engine serves the workload once to warm up (so every
prompt is cached, as in a lab run's later levels and repeats), then `--rounds` times in batches
of `--concurrency`, the engines in alternating order round by round. Reports output tok/s per
round, the median and its ratio to `none`'s, and whether the greedy outputs are identical.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.lab.workload import load_workload
from draftwise.paths import default_draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="code-easy")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policies", default="fixed,goodput")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [r.prompt for r in load_workload(args.workload).requests]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llms = {"none": LLM()}
    for policy in args.policies.split(","):
        for cached in (True, False):
            llm = LLM(draft=default_draft(), spec=SpecConfig(method="draft", k=4, policy=policy))
            if not cached:
                llm.engine.proposer.kv.prefix_cache = None
            llms[f"{policy}, drafter cache {'on' if cached else 'off'}"] = llm
    outputs = {name: [o.token_ids for o in llm.generate(prompts, sp)] for name, llm in llms.items()}
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for r in range(args.rounds):
        for name in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
            t0, n = time.perf_counter(), 0
            for i in range(0, len(prompts), args.concurrency):
                n += sum(len(o.token_ids) for o in llms[name].generate(prompts[i : i + args.concurrency], sp))
            rates[name].append(n / (time.perf_counter() - t0))
    base = statistics.median(rates["none"])
    print(f"{args.workload}, {args.concurrency} rows at a time, {args.rounds} rounds, {args.threads} threads")
    print("| engine | out tok/s per round | median | vs none | greedy == none |")
    print("|---|---|---|---|---|")
    for name, v in rates.items():
        same = outputs[name] == outputs["none"]
        print(f"| {name} | {' / '.join(f'{x:.1f}' for x in v)} | {statistics.median(v):.1f} | "
              f"{statistics.median(v) / base:.3f}x | {same} |")


if __name__ == "__main__":
    main()
