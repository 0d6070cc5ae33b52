"""Weight-only int8 and int4 beside float32 and bfloat16: batch-1 decoding speed and the quality cost.

    .venv/bin/python benchmarks/quantization.py [--models target,smollm2] [--tokens 64] [--rounds 3]
        [--threads 2] [--ppl-tokens 4096] [--skip-quality]

Side by side in one process: every model is loaded in each setting (float32, bfloat16, int8 and
int4 with float32 activations, int8 and int4 with bfloat16 activations); each round decodes every prompt once per
setting, in alternation, so the machine's noise falls on all. The rate is tokens after the first
over their seconds (the engine stepped by hand, timestamps per step: prefill excluded), summed over
prompts and rounds; the best round is printed too. The embedded pair also runs speculative
decoding (draft, k=4) with float targets and with the int8 (int4) target + int8 (int4) draft.

Quality: perplexity of each setting on held-out stdlib text (draftwise.corpus's held-out split,
`--ppl-tokens` tokens in windows of 256, the full causal forward), and for the pair the mean
accepted length of speculative decoding (greedy, the same prompts). `uptime`'s load is printed at
the start and the end: the machine is shared.
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch

PROMPTS = [
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "The three most important ideas in computer science are",
]
SETTINGS = [("float32", "float32", None), ("bfloat16", "bfloat16", None), ("int8 (f32 act)", "float32", "int8"),
            ("int8 (bf16 act)", "bfloat16", "int8"), ("int4 (f32 act)", "float32", "int4"),
            ("int4 (bf16 act)", "bfloat16", "int4")]


def decode(llm, ids: list[int], tokens: int) -> tuple[int, float]:
    """(tokens after the first, their seconds) of one greedy request."""
    from draftwise import SamplingParams

    eng = llm.engine
    eng.add_request("q", ids, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    first, n, n_first, t = None, 0, 0, 0.0
    while eng.has_unfinished():
        outs = eng.step()
        t = time.perf_counter()
        for o in outs:
            n += len(o.new_token_ids)
            if first is None and o.new_token_ids:
                first, n_first = t, n
            if o.finished:
                eng.release(o.seq.request_id)
    return n - n_first, t - first


def perplexity(model, tokenizer, n_tokens: int, seq: int = 256) -> float:
    from draftwise.corpus import split

    ids: list[int] = []
    for _, text in split().texts("held_out"):
        ids += tokenizer.encode(text).ids
        if len(ids) >= n_tokens + 1:
            break
    windows = torch.tensor(ids[: (len(ids) - 1) // seq * seq + 1][: n_tokens // seq * seq + 1])
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows) - 1, seq):
            w = windows[i: i + seq + 1][None]
            logits = model.logits(w[:, :-1]).float()
            total += float(torch.nn.functional.cross_entropy(logits[0], w[0, 1:], reduction="sum"))
            n += w.shape[1] - 1
    return math.exp(total / n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="target,smollm2", help="'target' = the embedded pair; others: model names")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--skip-quality", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from draftwise import LLM, SpecConfig

    print(f"load at start: {os.getloadavg()}  threads {args.threads}, {args.tokens} tokens x {len(PROMPTS)} prompts "
          f"x {args.rounds} rounds", flush=True)
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        model = None if name == "target" else name
        small = dict(kv_cache_memory="64MiB", max_model_len=1024)  # several engines in one process
        llms = {label: LLM(model, spec=SpecConfig(method=None), dtype=dt, quantization=q, **small)
                for label, dt, q in SETTINGS}
        if model is None:  # the pair: float targets + the default (bfloat16) draft, int8 target + int8 draft
            for label, dt, q in [("spec float32", "float32", None), ("spec bfloat16", "bfloat16", None),
                                 ("spec int8 (f32 act)", "float32", "int8"), ("spec int8 (bf16 act)", "bfloat16", "int8"),
                                 ("spec int4 (f32 act)", "float32", "int4")]:
                llms[label] = LLM(None, spec=SpecConfig(method="draft", k=4), dtype=dt, quantization=q, **small)
        tok = next(iter(llms.values())).tokenizer
        prompts = [tok.encode(p).ids for p in PROMPTS]
        for llm in llms.values():  # warm-up (kernels, oneDNN primitives)
            decode(llm, prompts[0], 8)
        sums = {label: [0, 0.0] for label in llms}
        best = {label: 0.0 for label in llms}
        for _ in range(args.rounds):
            for label, llm in llms.items():
                n_r, t_r = 0, 0.0
                for ids in prompts:
                    n, t = decode(llm, ids, args.tokens)
                    n_r, t_r = n_r + n, t_r + t
                sums[label][0] += n_r
                sums[label][1] += t_r
                best[label] = max(best[label], n_r / t_r)
        print(f"\n## {name}: batch-1 greedy decoding, tok/s (all rounds / best round)", flush=True)
        base = sums["float32"][0] / sums["float32"][1]
        for label in llms:
            rate = sums[label][0] / sums[label][1]
            print(f"{label:22s} {rate:7.1f} / {best[label]:7.1f}   {rate / base:4.2f}x float32", flush=True)
        if args.skip_quality:
            continue
        print(f"\n## {name}: quality", flush=True)
        for label, dt, q in SETTINGS:
            ppl = perplexity(llms[label].engine.runner.model, tok, args.ppl_tokens)
            print(f"{label:22s} held-out perplexity {ppl:8.3f} ({args.ppl_tokens} tokens)", flush=True)
        from draftwise import SamplingParams

        for label in [lb for lb in llms if lb.startswith("spec")]:
            outs = llms[label].generate(prompts, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
            prop = sum(o.stats.proposed_tokens for o in outs)
            acc = sum(o.stats.accepted_tokens for o in outs)
            mal = sum(o.stats.mean_accepted_length for o in outs) / len(outs)
            print(f"{label:22s} acceptance {acc}/{prop} = {acc / max(prop, 1):.3f}, mean accepted length {mal:.2f}",
                  flush=True)
    print(f"\nload at end: {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
