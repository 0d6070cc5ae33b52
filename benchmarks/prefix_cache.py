"""Prefix caching, side by side in one process: TTFT with and without the cache on a workload whose
requests share a long prefix, and greedy equality of the outputs.

    .venv/bin/python benchmarks/prefix_cache.py [--workload shared-prefix] [--threads 2] [--max-tokens 32]
        [--concurrency 1]

Two engines on the same target (plain decoding): one with prefix caching (the default), one with
`enable_prefix_caching=False`. Requests are sent in the workload's order, alternating between the
engines request by request (or batch by batch at --concurrency > 1), so background noise falls on
both. TTFT = time from add_request to the first committed token, in the engine loop (no HTTP).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from draftwise import LLM, SamplingParams
from draftwise.lab.workload import load_workload


def run_batch(llm: LLM, prompts: list[str], sp: SamplingParams, tag: str):
    eng = llm.engine
    t0 = time.perf_counter()
    seqs = [eng.add_request(f"{tag}-{i}", p, sp) for i, p in enumerate(prompts)]
    ttft = {}
    while eng.has_unfinished():
        eng.step()
        now = time.perf_counter()
        for s in seqs:
            if s.output_ids and s.request_id not in ttft:
                ttft[s.request_id] = now - t0
    for s in seqs:
        eng.release(s.request_id)
    return [ttft[s.request_id] for s in seqs], [list(s.output_ids) for s in seqs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="shared-prefix")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reqs = load_workload(args.workload).requests
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    on, off = LLM(args.model), LLM(args.model, enable_prefix_caching=False)
    for llm in (on, off):  # warm-up on an unrelated prompt
        llm.generate(["def warm_up(x):\n"], SamplingParams(temperature=0, max_tokens=4))
    t_on, t_off, same = [], [], 0
    for i in range(0, len(reqs), args.concurrency):
        prompts = [r.prompt for r in reqs[i : i + args.concurrency]]
        a, out_a = run_batch(on, prompts, sp, f"on{i}")
        b, out_b = run_batch(off, prompts, sp, f"off{i}")
        t_on += a
        t_off += b
        same += sum(x == y for x, y in zip(out_a, out_b))
    st = on.engine.stats
    p50_on, p50_off = statistics.median(t_on), statistics.median(t_off)
    print(f"workload {args.workload}: {len(reqs)} requests, concurrency {args.concurrency}, "
          f"{args.max_tokens} tokens, {torch.get_num_threads()} threads")
    print(f"TTFT p50: cache {1000 * p50_on:.1f} ms, no cache {1000 * p50_off:.1f} ms, ratio {p50_on / p50_off:.2f}x")
    print(f"prefix cache hits: {st.prefix_cache_hit_tokens} of {st.prefix_cache_queried_tokens} prompt tokens "
          f"({st.prefix_cache_hit_tokens / max(1, st.prefix_cache_queried_tokens):.0%})")
    print(f"greedy outputs identical: {same}/{len(reqs)}")


if __name__ == "__main__":
    main()
