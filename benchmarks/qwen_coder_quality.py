"""The Qwen2.5-Coder pair imported by draftwise against transformers, and its quantized import
against its float one.

    .venv/bin/python benchmarks/qwen_coder_quality.py --float-dir DIR [--models 1.5b,0.5b] [--tokens 64]
        [--ppl-tokens 4096] [--threads 2] [--out benchmarks/results/qwen-coder-quality.json]

`--float-dir` holds float32 imports of the two GGUFs (`draftwise import-gguf FILE --out
DIR/<name>-f32`, no --keep-quantized: 6.7 GB and 2.4 GB, not written by `make qwen-coder`).
For each model:

- greedy: 6 code chat prompts (qwen_coder_prompts.py) x `--tokens` tokens, EOS ignored, from
  transformers' float32 forward (step by step with its K/V cache) and from draftwise's float32 import
  (the engine, plain decoding): the number of prompts whose tokens are equal, and the first
  differing position elsewhere; draftwise's quantized import (`models/<name>`, its blocks as
  stored) against the float one the same way (informative: 4-bit weights may change tokens);
- held-out perplexity of the float and the quantized import: stdlib source text the models were
  not tuned on (draftwise.corpus's held-out split), `--ppl-tokens` tokens in windows of 256, the
  full causal forward.

Only one model's float weights are in memory at a time.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen_coder_prompts import DRAFT, PROMPTS, TARGET, chat_ids  # noqa: E402

NAMES = {"1.5b": TARGET, "0.5b": DRAFT}


def transformers_greedy(path: Path, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy tokens of transformers' float32 model, one prompt at a time, EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = model(torch.tensor([ids]), use_cache=True)
            past, got = out.past_key_values, []
            for _ in range(tokens):
                nxt = int(out.logits[0, -1].argmax())
                got.append(nxt)
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
            outs.append(got)
    del model
    gc.collect()
    return outs


def draftwise_greedy(path: str | Path, prompts: list[list[int]], tokens: int, dtype: str = "float32"):
    """(greedy tokens per prompt, the engine's LLM) of draftwise's plain decoding, EOS ignored."""
    from draftwise import LLM, SamplingParams, SpecConfig

    llm = LLM(str(path), spec=SpecConfig(method=None), dtype=dtype, kv_cache_memory="256MiB", max_model_len=2048)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    return [o.token_ids for o in outs], llm


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many prompts' tokens are equal; per prompt the first differing position (None: equal)."""
    first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), None if len(s) == len(t) else min(len(s), len(t)))
             for s, t in zip(a, b)]
    return {"equal": sum(f is None for f in first), "prompts": len(a), "first_difference": first}


def perplexity(model, tokenizer, n_tokens: int, seq: int = 256) -> float:
    from draftwise.corpus import split

    ids: list[int] = []
    for _, text in sorted(split().texts("held_out")):
        ids += tokenizer.encode(text).ids
        if len(ids) >= n_tokens + 1:
            break
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, n_tokens // seq * seq, seq):
            w = torch.tensor(ids[i: i + seq + 1])[None]
            logits = model.logits(w[:, :-1]).float()
            total += float(torch.nn.functional.cross_entropy(logits[0], w[0, 1:], reduction="sum"))
            n += w.shape[1] - 1
    return math.exp(total / n)


def run_model(key: str, float_dir: Path, tokens: int, ppl_tokens: int) -> dict:
    name = NAMES[key]
    fdir = float_dir / f"{name}-f32"
    from tokenizers import Tokenizer

    from draftwise.paths import resolve_model

    tok = Tokenizer.from_file(str(resolve_model(name) / "tokenizer.json"))
    prompts = [chat_ids(name, tok, p) for p in PROMPTS]
    q_tokens, q_llm = draftwise_greedy(name, prompts, tokens)
    q_ppl = perplexity(q_llm.engine.runner.model, tok, ppl_tokens)
    del q_llm
    gc.collect()
    fl_tokens, llm = draftwise_greedy(fdir, prompts, tokens)
    fl_ppl = perplexity(llm.engine.runner.model, llm.tokenizer, ppl_tokens)
    del llm
    gc.collect()
    hf_tokens = transformers_greedy(fdir, prompts, tokens)
    row = {
        "model": name, "tokens": tokens,
        "float_vs_transformers": compare(fl_tokens, hf_tokens),
        "quantized_vs_float": compare(q_tokens, fl_tokens),
        "ppl_float": round(fl_ppl, 4), "ppl_quantized": round(q_ppl, 4),
        "ppl_ratio": round(q_ppl / fl_ppl, 4), "ppl_tokens": ppl_tokens,
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--float-dir", type=Path, required=True)
    ap.add_argument("--models", default="1.5b,0.5b")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load at start: {os.getloadavg()}  cpu: {platform.processor() or platform.machine()}", flush=True)
    rows = [run_model(k.strip(), args.float_dir, args.tokens, args.ppl_tokens) for k in args.models.split(",")]
    if args.out:
        args.out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"load at end: {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
