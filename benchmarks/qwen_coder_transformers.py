"""The Qwen2.5-Coder pair beside transformers' assisted generation: batch 1, greedy, code chat prompts.

    .venv/bin/python benchmarks/qwen_coder_vllm.py floats        # the float32 directories (once)
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/qwen_coder_transformers.py [--dtype bfloat16]
        [--tokens 128] [--prompts 6] [--k 4] [--threads 2] [--configs plain,draft-cheap] [--out FILE.json]

transformers (a benchmark-only peer; the project's dev dependency) loads the float32 directories
`qwen_coder_vllm.py floats` dequantised from the two GGUF files (~/.cache/draftwise-peers/<name>-f32)
in --dtype and runs `generate` plain and with `assistant_model` = the 0.5B (`num_assistant_tokens`
= k, constant schedule, confidence threshold 0: a fixed draft length, as draftwise's fixed policy);
draftwise runs its own imports of the same files (models/<name>, the GGUF blocks kept) with the
configs of qwen_coder_peers.py. Every prompt runs on every engine in turn, so the machine's noise
falls on all. Rates are decode rates after the first token (transformers: a run's seconds less
those of a one-token run of the same prompt; draftwise: its step timestamps); greedy equality is checked within each engine (assisted against
transformers plain, speculative against draftwise plain): the two engines run different weights
(float against the kept blocks), so their tokens are not compared with each other.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen_coder_peers import draftwise_engines  # noqa: E402
from qwen_coder_prompts import DRAFT, PROMPTS, TARGET, render  # noqa: E402
from qwen_coder_speed import decode  # noqa: E402
from qwen_coder_vllm import float_dir  # noqa: E402


def transformers_decode(model, ids: list[int], tokens: int, **kw) -> tuple[list[int], int, float]:
    """(tokens, tokens after the first, their seconds) of one greedy `generate`, EOS ignored. The
    first token's time is a separate one-token `generate` of the same prompt, subtracted from the
    whole run's (an assisted `generate` hands a streamer its tokens in bursts, so a streamer's
    timestamps do not tell when the first arrived)."""
    def run(n: int):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
        return out[0, len(ids):].tolist(), time.perf_counter() - t0

    _, first = run(1)
    new, total = run(tokens)
    return new, len(new) - 1, total - first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--configs", default="plain,draft-cheap", help="draftwise's configs (qwen_coder_peers.py)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    for name in (TARGET, DRAFT):
        if not (float_dir(name) / "config.json").is_file():
            print(f"skipped: {float_dir(name)} not found (benchmarks/qwen_coder_vllm.py floats makes it)")
            return 0
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    print(f"load at start: {os.getloadavg()}", flush=True)
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(float_dir(TARGET), dtype=dtype).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(float_dir(DRAFT), dtype=dtype).eval()
    llms = draftwise_engines(args.configs.split(","), args.k)
    tok = next(iter(llms.values())).tokenizer
    ids = [tok.encode(render(TARGET, p), add_special_tokens=False).ids for p in PROMPTS[: args.prompts]]
    assisted = dict(assistant_model=hf_draft, num_assistant_tokens=args.k, num_assistant_tokens_schedule="constant",
                    assistant_confidence_threshold=0.0)
    runs = {"transformers plain": lambda p: transformers_decode(hf, p, args.tokens),
            f"transformers assisted k={args.k}": lambda p: transformers_decode(hf, p, args.tokens, **assisted)}
    for label, llm in llms.items():
        runs[label] = (lambda llm: lambda p: decode(llm, p, args.tokens)[:3])(llm)
    for run in runs.values():  # warm-up
        run(ids[0][:32])
    n = {e: 0 for e in runs}
    s = {e: 0.0 for e in runs}
    outs: dict[str, list] = {e: [] for e in runs}
    for p in ids:
        for e, run in runs.items():
            out, k, sec = run(p)
            outs[e].append(out)
            n[e] += k
            s[e] += sec
            print(f"  {e}: {k / sec:.2f} tok/s", flush=True)
    rate = {e: n[e] / s[e] for e in runs}
    plain_of = {e: ("transformers plain" if e.startswith("transformers") else "draftwise plain") for e in runs}
    same = {e: outs[e] == outs[plain_of[e]] for e in runs if plain_of[e] in outs and e != plain_of[e]}
    hf_plain = rate["transformers plain"]
    print(f"batch 1, greedy, {args.tokens} tokens, {len(ids)} code chat prompts, {args.threads} threads, "
          f"transformers in {args.dtype}", flush=True)
    for e in runs:
        own = rate[e] / rate[plain_of[e]] if plain_of[e] in rate else float("nan")
        tail = f"  greedy = its plain: {same[e]}" if e in same else ""
        print(f"  {e:34s} {rate[e]:6.2f} tok/s  {own:4.2f}x its plain  {rate[e] / hf_plain:4.2f}x transformers plain"
              f"{tail}", flush=True)
    print(f"load at end: {os.getloadavg()}", flush=True)
    if args.out:
        result = {"tokens": args.tokens, "threads": args.threads, "prompts": len(ids), "dtype": args.dtype,
                  "k": args.k, "decode tok/s": {e: round(r, 2) for e, r in rate.items()},
                  "greedy equal to its plain": same}
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
