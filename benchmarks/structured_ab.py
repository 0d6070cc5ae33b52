"""Structured output, side by side in one process: constrained plain decoding against constrained
speculation (with and without the grammar's forced tokens as free proposals beyond k), with the
requests interleaved so that background load falls on every config alike.

    .venv/bin/python benchmarks/structured_ab.py [--workload json] [--configs none,draft:k=4:forced=0,draft:k=4]
        [--num-requests 8] [--reps 2] [--concurrency 1] [--threads 1]

The embedded pair (target float32, draft bfloat16, as `draftwise bench`). At concurrency 1 every
request runs alone through each config in turn (the order rotates request by request); at
concurrency c, batches of c requests do. Per config: output tokens per second of engine time,
mean committed tokens per round, the grammar's work per engine step against `none`'s engine time
per step (prefill steps included), validity of every constrained output (a fresh matcher: complete,
valid prefix at max_tokens, invalid) and greedy mismatches against `none`.
"""
from __future__ import annotations

import argparse
import time

import torch

from draftwise.engine import EngineConfig, LLMEngine
from draftwise.engine.stats import EngineStats
from draftwise.lab.backends import sampling_params
from draftwise.lab.runner import parse_configs
from draftwise.lab.workload import load_workload
from draftwise.model.pair import load_pair
from draftwise.sampling.grammar import GrammarState


def validity(eng, spec, tokens: list[int], reason: str) -> str:
    g = GrammarState.create(eng.tokenizer, eng.vocab_size, eng.eos_ids, spec)
    try:
        ended = any(g.accept(t) for t in tokens)
    except ValueError:
        return "invalid"
    return "complete" if ended else "valid_prefix" if reason == "length" else "invalid"


def run_batch(eng, reqs, tag: str):
    t0 = time.perf_counter()
    seqs = [eng.add_request(f"{tag}-{i}", r.prompt, sampling_params(r, seed=i)) for i, r in enumerate(reqs)]
    while eng.has_unfinished():
        eng.step()
    dt = time.perf_counter() - t0
    out = [(list(s.output_ids), s.finish_reason) for s in seqs]
    for s in seqs:
        eng.release(s.request_id)
    return dt, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="json")
    ap.add_argument("--configs", default="none,draft:k=4:forced=0,draft:k=4,ngram:k=4:forced=0,ngram:k=4")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", default=None,
                    help="a hardware profile for the goodput policy (default: measured once and cached)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reqs = load_workload(args.workload).requests[: args.num_requests]
    configs = parse_configs(args.configs, profile=args.profile)
    target, draft = load_pair(None, None, needs_draft=True)
    need = max(len(target.tokenizer.encode(r.prompt).ids) + r.max_tokens for r in reqs)
    engines = {}
    for c in configs:
        ecfg = EngineConfig(max_num_seqs=args.concurrency,
                            kv_cache_max_tokens=args.concurrency * (need + 2 * c.k + 16))
        engines[c.label] = LLMEngine(target, draft if c.method == "draft" else None, c.spec, ecfg)
        run_batch(engines[c.label], reqs[:1], "warm")  # first-use costs (kernels, grammar compile)
        engines[c.label].stats = EngineStats(accepted_per_position=[])
    seconds = {c.label: 0.0 for c in configs}
    outputs = {c.label: [] for c in configs}
    batches = [reqs[i : i + args.concurrency] for i in range(0, len(reqs), args.concurrency)]
    n = 0
    for rep in range(args.reps):
        for b, batch in enumerate(batches):
            order = configs[n % len(configs):] + configs[: n % len(configs)]
            n += 1
            for c in order:
                dt, out = run_batch(engines[c.label], batch, f"r{rep}b{b}")
                seconds[c.label] += dt
                if rep == 0:
                    outputs[c.label] += out
    print(f"workload {args.workload}: {len(reqs)} requests x {args.reps} reps, concurrency {args.concurrency}, "
          f"{torch.get_num_threads()} threads")
    base = outputs.get("none")
    st0 = engines["none"].stats if "none" in engines else None
    plain_step = (st0.propose_seconds + st0.verify_seconds + st0.other_seconds) / st0.steps if st0 else None
    rate0 = None
    for c in configs:
        st = engines[c.label].stats
        tokens = st.generation_tokens
        rate = tokens / seconds[c.label]
        rate0 = rate0 or (rate if c.label == "none" else None)
        valid = {"complete": 0, "valid_prefix": 0, "invalid": 0}
        for r, (toks, reason) in zip(reqs, outputs[c.label]):
            if r.structured_output is not None:
                valid[validity(engines[c.label], r.structured_output, toks, reason)] += 1
        mism = sum(a[0] != b[0] for a, b in zip(outputs[c.label], base)) if base else None
        gstep = 1000.0 * st.grammar_seconds / max(1, st.steps)
        share = f" ({100 * gstep / (1000.0 * plain_step):.1f}% of a plain step)" if plain_step else ""
        mal = st.committed_tokens / st.rounds if st.rounds else 1.0
        print(f"{c.label:28s} {rate:7.1f} tok/s  {rate / rate0 if rate0 else 1:5.2f}x  mean accepted length {mal:.2f}  "
              f"forced {st.forced_tokens:5d}  grammar {gstep:.2f} ms/step{share}  "
              f"valid {valid}  greedy mismatches {mism}/{len(reqs)}")
    if plain_step:
        print(f"plain step (none, engine time per step, prefill steps included): {1000.0 * plain_step:.2f} ms")


if __name__ == "__main__":
    main()
