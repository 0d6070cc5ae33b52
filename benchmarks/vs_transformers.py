"""draftwise vs transformers on the same checkpoint, in one process, batch 1, greedy.

    .venv/bin/python benchmarks/vs_transformers.py [--model DIR --draft DIR] [--dtype float32|bfloat16]
        [--tokens 256] [--prompt-tokens 64] [--k 4] [--threads 2] [--repeats 2] [--prompts code|random]

Runs transformers `generate` (plain, and with `assistant_model`: same K, constant schedule,
confidence threshold 0) and draftwise plain and speculative (draft model, same K) on the same
prompts and prints tokens/s and the ratios. Also times one target step at 1 and K+1 tokens and one
draft step (the per-step costs that decide whether speculation can pay; each the median of 7 means
of 10 warm steps, as this machine's noise comes in bursts). Without --model it uses
the embedded pair (models/target, models/draft). Prompts: `code` (default) takes 64-token windows
of the held-out standard-library files the embedded pair never trained on (evenly spaced, from a
line start); `random` draws token ids uniformly (what acceptance looks like on noise).
"""
from __future__ import annotations

import argparse
import time

import torch


def code_prompts(tok, n_tokens: int, n: int) -> list[list[int]]:
    """`n` windows of `n_tokens` tokens from held-out stdlib files, one per file, evenly spaced
    over the files (sorted by path), each starting at the first line start after 1/3 of the file."""
    from draftwise.train import corpus

    files = [(p, t) for p, t in sorted(corpus.split().texts("held_out")) if len(t) > 8000]
    out = []
    for i in range(n):
        _, text = files[(i * len(files)) // n]
        start = text.index("\n", len(text) // 3) + 1
        ids = tok.encode(text[start:]).ids[:n_tokens]
        out.append(ids)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--prompts", default="code", choices=["code", "random"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from draftwise import LLM, SamplingParams, SpecConfig
    from draftwise.paths import default_draft, default_target

    target = args.model or str(default_target())
    draft = args.draft or str(default_draft())
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    plain = LLM(target, dtype=args.dtype)
    V = plain.engine.vocab_size
    if args.prompts == "code":
        prompts = code_prompts(plain.tokenizer, args.prompt_tokens, args.repeats)
    else:
        prompts = [torch.randint(1, V, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.repeats)]
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    rows = {}

    def run_draftwise(llm, name):
        llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        t0 = time.perf_counter()
        outs = [llm.generate(p, sp)[0] for p in prompts]
        dt = time.perf_counter() - t0
        rows[name] = sum(len(o.token_ids) for o in outs) / dt
        return outs

    base = run_draftwise(plain, "draftwise plain")
    spec = LLM(target, draft=draft, spec=SpecConfig(method="draft", k=args.k), dtype=args.dtype)
    souts = run_draftwise(spec, f"draftwise speculative k={args.k}")
    same = all(a.token_ids == b.token_ids for a, b in zip(base, souts))
    mal = sum(o.stats.committed_in_rounds for o in souts) / max(1, sum(o.stats.rounds for o in souts))

    # per-step costs
    def step_ms(runner, T, n=10, repeats=7):  # the median of `repeats` means of n steps (noise)
        runner.kv.reserve(10**6, args.prompt_tokens + T + 8)
        runner.run([10**6], [prompts[0]], [0], [1])
        for _ in range(3):
            runner.run([10**6], [[5] * T], [args.prompt_tokens], [T])
        means = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(n):
                runner.run([10**6], [[5] * T], [args.prompt_tokens], [T])
            means.append((time.perf_counter() - t0) / n * 1e3)
        runner.kv.free(10**6)
        return sorted(means)[repeats // 2]

    t1 = step_ms(plain.engine.runner, 1)
    tk = step_ms(plain.engine.runner, args.k + 1)
    td = step_ms(spec.engine.proposer.runner, 1)

    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval()
        hf_draft = AutoModelForCausalLM.from_pretrained(draft, dtype=dtype).eval()

        def run_hf(name, **kw):
            with torch.no_grad():
                ids = torch.tensor([prompts[0]])
                hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, **kw)
                t0 = time.perf_counter()
                n = 0
                for p in prompts:
                    out = hf.generate(torch.tensor([p]), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                      do_sample=False, **kw)
                    n += out.shape[1] - len(p)
                rows[name] = n / (time.perf_counter() - t0)

        run_hf("transformers plain")
        run_hf(f"transformers assisted k={args.k}", assistant_model=hf_draft, num_assistant_tokens=args.k,
               num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)

    ddt = str(next(spec.engine.proposer.runner.model.parameters()).dtype).replace("torch.", "")
    print(f"target {target}, draft {draft} (draftwise runs it in {ddt}), dtype {args.dtype}, threads {args.threads}, "
          f"{args.prompt_tokens}-token {args.prompts} prompts, {args.tokens} greedy tokens, batch 1, {args.repeats} prompts")
    for name, v in rows.items():
        print(f"  {name:34s} {v:8.1f} tok/s")
    print(f"  speculative output identical to plain: {same}; mean accepted length {mal:.2f}")
    print(f"  target step: 1 token {t1:.2f} ms, {args.k + 1} tokens {tk:.2f} ms ({tk / t1:.2f}x); "
          f"draft step {td:.2f} ms ({td / t1 * 100:.1f}% of a target step)")
    if "transformers plain" in rows:
        print(f"  draftwise plain / transformers plain: {rows['draftwise plain'] / rows['transformers plain']:.2f}x")
        k = args.k
        print(f"  draftwise speculative / transformers assisted: "
              f"{rows[f'draftwise speculative k={k}'] / rows[f'transformers assisted k={k}']:.2f}x")
    print(f"  draftwise speculative / draftwise plain: {rows[f'draftwise speculative k={args.k}'] / rows['draftwise plain']:.2f}x")


if __name__ == "__main__":
    main()
