"""Batch-1 speed of the Qwen2.5-Coder pair (make qwen-coder): plain, the 0.5B draft, n-gram; the
cost of a verification block against a decode step; prefill.

    .venv/bin/python benchmarks/qwen_coder_speed.py [--quant stored|int8]
        [--configs plain,plain#2,draft,draft-int4,draft-vocab,draft-cheap,ngram,cross]
        [--tokens 128] [--k 4] [--cross-k 4,2] [--cross-quant none|int8|int4] [--cross-modes text,shared]
        [--cross-draft DIR] [--cross-vocab N] [--threads 2] [--rounds 1] [--clock wall|cpu] [--out FILE.json]
        [--steps-only] [--step-rows 1,5,8,12,17] [--no-amx-copies]

For each target quantization (`stored`: the import's own blocks, Q4_K as int4 and Q6_K as int8
groups; `int8`: every block as int8 groups; a comma list runs them in one process, but each engine
holds its own copy of the models):

- step cost: one target step of 1 token and of k + 1 tokens (logits for every row, as
  verification asks), after a 64-token context; the median of 7 means of 10 warm steps
  (`--steps-only`: only these, with the plain target alone loaded);
- decode: the 6 code chat prompts of qwen_coder_prompts.py, `--tokens` greedy tokens each (EOS
  ignored), plain / `--method draft` with the 0.5B (k = `--k`) / n-gram / `cross`: SmolLM2-135M
  (models/smollm2, another tokenizer) drafting across vocabularies, at each k of `--cross-k`, greedy
  rows drafting re-tokenized text or over the shared tokens (`--cross-modes`); tok/s counts the tokens
  after the first over their seconds (prefill excluded); rounds alternate the settings, so the
  machine's noise falls on all; speculative greedy tokens are checked equal to plain's;
- prefill: the seconds to the first token of the 182-token chat prompt (plain, not in the prefix
  cache).
- `--no-amx-copies`: on a CPU with AMX tiles (kernels/amx.c), every config, step and the prefill
  also run with the products kept on VPDPBUSD, in the same process, interleaved; `--step-rows`
  adds the step cost at those row counts (both ways with `--no-amx-copies`).

`uptime`'s load is printed at the start and the end: the machine may be shared. On a machine
shared with other work, wall-clock rates measure the share this process got; `--clock cpu` (one
thread) times by the process's CPU seconds instead, which other processes barely change (they
still share the caches and the memory bandwidth).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from draftwise.model import cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen_coder_prompts import DRAFT, LONG_PROMPT, PROMPTS, TARGET, chat_ids  # noqa: E402

CROSS_DRAFT = "smollm2"  # SmolLM2-135M-Instruct: another tokenizer (vocabulary 49,152)


NO_AMX = "[no AMX]"  # the label suffix of --no-amx-copies' engines
CHEAP_VOCAB = 32768  # --draft-vocab of the draft-vocab / draft-cheap configs
CLOCK = time.perf_counter  # or time.process_time (--clock cpu)


def decode(llm, ids: list[int], tokens: int) -> tuple[list[int], int, float, float]:
    """(tokens, tokens after the first, their seconds, seconds to the first) of one greedy request."""
    from draftwise import SamplingParams

    eng = llm.engine
    rid = f"r{time.perf_counter_ns()}"
    eng.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    t0 = CLOCK()
    first, n, n_first, t, out = None, 0, 0, 0.0, []
    while eng.has_unfinished():
        outs = eng.step()
        t = CLOCK()
        for o in outs:
            n += len(o.new_token_ids)
            out += o.new_token_ids
            if first is None and o.new_token_ids:
                first, n_first = t, n
    return out, n - n_first, t - first, first - t0


def _counters(st) -> tuple:
    """The engine's counters a decode run is measured by (differences before/after)."""
    return (st.accepted_tokens, st.verified_tokens, st.rounds, st.committed_tokens, st.steps,
            st.propose_seconds, st.verify_seconds, st.other_seconds)


def step_ms(runner, prompt: list[int], T: int, n: int = 10, repeats: int = 7) -> float:
    """The median of `repeats` means of `n` steps of T new tokens (logits for all T)."""
    sid = 10**6
    runner.kv.reserve(sid, len(prompt) + T + 8)
    runner.run([sid], [prompt], [0], [1])
    for _ in range(3):
        runner.run([sid], [[5] * T], [len(prompt)], [T])
    means = []
    for _ in range(repeats):
        t0 = CLOCK()
        for _ in range(n):
            runner.run([sid], [[5] * T], [len(prompt)], [T])
        means.append((CLOCK() - t0) / n * 1e3)
    runner.kv.free(sid)
    return sorted(means)[repeats // 2]


def engines(quant: str, k: int, configs: list[str], cross_ks: list[int] = (), cross_quant: str = "none",
            cross_modes: list[str] = ("text",), cross_draft: str = CROSS_DRAFT, cross_vocab: int | None = None) -> dict:
    from draftwise import LLM, SpecConfig

    q = None if quant == "stored" else quant
    small = dict(kv_cache_memory="256MiB", max_model_len=2048)
    out = {f"{quant} plain": LLM(TARGET, spec=SpecConfig(method=None), quantization=q, **small)}
    if "plain#2" in configs:  # a second plain engine: the A/A control of the ratios
        out[f"{quant} plain#2"] = LLM(TARGET, spec=SpecConfig(method=None), quantization=q, **small)
    if "draft" in configs:
        out[f"{quant} draft k={k}"] = LLM(TARGET, draft=DRAFT, spec=SpecConfig(method="draft", k=k), quantization=q,
                                          **small)
    cheap = {"draft-int4": dict(draft_quantization="int4"), "draft-vocab": dict(draft_vocab=CHEAP_VOCAB),
             "draft-cheap": dict(draft_quantization="int4", draft_vocab=CHEAP_VOCAB)}
    for name, kw in cheap.items():
        if name in configs:  # a cheaper draft step: int4 layers, a head over the frequent tokens, or both
            out[f"{quant} {name} k={k}"] = LLM(TARGET, draft=DRAFT, spec=SpecConfig(method="draft", k=k),
                                               quantization=q, **kw, **small)
    if "ngram" in configs:
        out[f"{quant} ngram"] = LLM(TARGET, spec=SpecConfig(method="ngram", k=k), quantization=q, **small)
    cq = None if cross_quant == "none" else cross_quant
    for ck in cross_ks if "cross" in configs else ():
        for mode in cross_modes:
            llm = LLM(TARGET, draft=cross_draft, spec=SpecConfig(method="draft", k=ck), quantization=q,
                      draft_quantization=cq, draft_vocab=cross_vocab, **small)
            kind = mode.split("#")[0]  # (text#2: a second engine of the same setting, the A/A control)
            llm.engine.proposer.text = kind == "text"  # greedy rows: re-tokenized text, or the intersection
            tag = ("-" + cq if cq else "") + (f"-v{cross_vocab}" if cross_vocab else "")
            out[f"{quant} smollm2{tag} {mode} k={ck}"] = llm
    return out


def tiles(on: bool) -> bool:
    """Products on AMX tiles (from DRAFTWISE_AMX's row count) or kept on VPDPBUSD; whether the tiles exist."""
    return cpu_kernels.set_amx(cpu_kernels.amx_min_rows() if on else 0)


def row_counts(text: str) -> list[int]:
    """--step-rows: comma-separated row counts >= 1."""
    try:
        rows = [int(x) for x in text.split(",")]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"row counts >= 1, comma-separated (e.g. 1,5,8), not {text!r}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", default="stored")  # (each setting loads its own copies: one at a time fits)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"])
    ap.add_argument("--configs", default="plain,draft,ngram",
                    help="plain, plain#2 (a second plain engine: A/A), draft, draft-int4 (the draft's layers int4), "
                         f"draft-vocab (its head over the {CHEAP_VOCAB} most frequent tokens), draft-cheap (both), "
                         "ngram, cross (SmolLM2)")
    ap.add_argument("--cross-k", default="4,2", help="the cross config's k values")
    ap.add_argument("--cross-quant", default="none", choices=["none", "int8", "int4"],
                    help="the cross config's draft quantization (--draft-quantization)")
    ap.add_argument("--cross-modes", default="text",
                    help="the cross config's greedy drafting: text (re-tokenized), shared (the intersection's argmax); "
                         "text#2: a second engine of the same setting (A/A)")
    ap.add_argument("--cross-draft", default=CROSS_DRAFT,
                    help="the cross config's draft (e.g. an import of SmolLM2's GGUF with --keep-quantized)")
    ap.add_argument("--cross-vocab", type=int, default=None,
                    help="the cross config's --draft-vocab (its head over its N most frequent tokens)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--steps-only", action="store_true", help="only the step cost (the plain target alone)")
    ap.add_argument("--step-rows", type=row_counts, default=[], help="also the step cost at these row counts (e.g. 1,5,8,12,17)")
    ap.add_argument("--no-amx-copies", action="store_true",
                    help="each config twice: also an engine whose products stay off AMX tiles (kernels/amx.c)")
    args = ap.parse_args()
    if args.steps_only:
        args.configs = "plain"
    global CLOCK
    if args.clock == "cpu":
        CLOCK, args.threads = time.process_time, 1
    torch.set_num_threads(args.threads)
    print(f"load at start: {os.getloadavg()}  threads {args.threads}", flush=True)
    if args.no_amx_copies and not tiles(True):
        print("no AMX tiles on this CPU (or build): the [no AMX] copies run the same products", flush=True)
    result = {"tokens": args.tokens, "k": args.k, "threads": args.threads, "clock": args.clock, "steps": {},
              "decode": {}, "prefill": {}}
    llms = {}
    for quant in args.quant.split(","):
        built = [engines(quant, args.k, args.configs.split(","), [int(x) for x in args.cross_k.split(",")],
                         args.cross_quant, args.cross_modes.split(","), args.cross_draft, args.cross_vocab)
                 for _ in range(1 + args.no_amx_copies)]
        llms.update(built[0])
        llms.update({f"{label} {NO_AMX}": llm for c in built[1:] for label, llm in c.items()})
        plain = llms[f"{quant} plain"]
        runner = plain.engine.runner
        ctx = chat_ids(TARGET, plain.tokenizer, PROMPTS[0])[:64]
        t1, tk = step_ms(runner, ctx, 1), step_ms(runner, ctx, args.k + 1)
        result["steps"][quant] = {"1 row ms": round(t1, 2), f"{args.k + 1} rows ms": round(tk, 2),
                                  "ratio": round(tk / t1, 3)}
        print(f"{quant}: target step 1 row {t1:.1f} ms, {args.k + 1} rows {tk:.1f} ms ({tk / t1:.2f}x)", flush=True)
        if args.no_amx_copies:  # the same steps with the products off the tiles
            tiles(False)
            t1, tk = step_ms(runner, ctx, 1), step_ms(runner, ctx, args.k + 1)
            tiles(True)
            result["steps"][f"{quant} {NO_AMX}"] = {"1 row ms": round(t1, 2), f"{args.k + 1} rows ms": round(tk, 2),
                                                   "ratio": round(tk / t1, 3)}
            print(f"{quant} {NO_AMX}: target step 1 row {t1:.1f} ms, {args.k + 1} rows {tk:.1f} ms ({tk / t1:.2f}x)",
                  flush=True)
        if args.step_rows:  # a step of T rows against one of 1 row, tiles and VPDPBUSD interleaved per T
            table = result["steps"].setdefault("by rows", {})
            for T in args.step_rows:
                for amx in (1, 0)[: 1 + args.no_amx_copies]:
                    tiles(amx)
                    key = f"{quant}{'' if amx else ' ' + NO_AMX}"
                    table.setdefault(key, {})[T] = round(step_ms(runner, ctx, T), 2)
                    print(f"{key}: {T} rows {table[key][T]:.1f} ms ({table[key][T] / table[key][1]:.2f}x 1 row)"
                          if 1 in table[key] else f"{key}: {T} rows {table[key][T]:.1f} ms", flush=True)
            tiles(True)
        if args.steps_only:
            continue
        long_ids = chat_ids(TARGET, plain.tokenizer, LONG_PROMPT)
        decode(plain, chat_ids(TARGET, plain.tokenizer, PROMPTS[1]), 2)  # warm-up (another prompt: no prefix
        _, _, _, ttft = decode(plain, long_ids, 2)                        # cached for the one measured)
        if args.no_amx_copies:
            tiles(False)
            twin = llms[f"{quant} plain {NO_AMX}"]
            decode(twin, chat_ids(TARGET, twin.tokenizer, PROMPTS[1]), 2)  # (its own warm-up)
            _, _, _, t0 = decode(twin, long_ids, 2)
            tiles(True)
            result["prefill"][f"{quant} {NO_AMX}"] = {"prompt tokens": len(long_ids), "seconds": round(t0, 3),
                                                     "tokens/s": round(len(long_ids) / t0, 1)}
            print(f"{quant} {NO_AMX}: prefill {len(long_ids)} tokens in {t0:.2f} s ({len(long_ids) / t0:.1f} tok/s)",
                  flush=True)
        result["prefill"][quant] = {"prompt tokens": len(long_ids), "seconds": round(ttft, 3),
                                    "tokens/s": round(len(long_ids) / ttft, 1)}
        print(f"{quant}: prefill {len(long_ids)} tokens in {ttft:.2f} s ({len(long_ids) / ttft:.1f} tok/s)", flush=True)
    if args.steps_only:
        print(f"load at end: {os.getloadavg()}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    tok = next(iter(llms.values())).tokenizer
    prompts = [chat_ids(TARGET, tok, p) for p in PROMPTS]
    for llm in llms.values():
        decode(llm, prompts[0], 8)  # warm-up
    before = {label: _counters(llm.engine.stats) for label, llm in llms.items()}
    sums = {label: [0, 0.0] for label in llms}
    texts = {label: [] for label in llms}
    for r in range(args.rounds):
        for label, llm in llms.items():
            tiles(not label.endswith(NO_AMX))
            for ids in prompts:
                out, n, t, _ = decode(llm, ids, args.tokens)
                sums[label][0] += n
                sums[label][1] += t
                if r == 0:
                    texts[label].append(out)
    tiles(True)
    for label in llms:
        quant = label.split()[0]
        rate = sums[label][0] / sums[label][1]
        base = sums[f"{quant} plain"][0] / sums[f"{quant} plain"][1]
        same = texts[label] == texts[f"{quant} plain"]
        st = llms[label].engine.stats
        acc, ver, rounds, com, steps, *secs = (a - b for a, b in zip(_counters(st), before[label]))
        acceptance = round(acc / ver, 3) if ver else None  # accepted / verified proposals (warm-up left out)
        per_round = round(com / rounds, 3) if rounds else None  # tokens committed per verification round
        result["decode"][label] = {"tok/s": round(rate, 2), "vs plain": round(rate / base, 3), "greedy equal": same,
                                   "acceptance": acceptance, "tokens per round": per_round,
                                   "ms per step": {name: round(x / steps * 1e3, 2) for name, x in
                                                   zip(("propose", "verify", "other"), secs)}}
        split = " / ".join(f"{x / steps * 1e3:.1f}" for x in secs)
        print(f"{label:30s} {rate:6.2f} tok/s  {rate / base:4.2f}x plain  acceptance {acceptance}  "
              f"tokens/round {per_round}  ms/step propose/verify/other {split}  greedy equal to plain: {same}",
              flush=True)
    print(f"load at end: {os.getloadavg()}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
