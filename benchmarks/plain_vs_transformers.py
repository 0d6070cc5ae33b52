"""Plain decoding, batch 1, greedy: draftwise vs transformers on one model directory (no draft).

    .venv/bin/python benchmarks/plain_vs_transformers.py --model smollm2 --dtype float32 [--tokens 128]
        [--threads 2] [--rounds 3]

The prompts are a few chat requests rendered with the model's chat template (the plain template
when it has none). Each round runs every prompt once in draftwise and once in transformers, in
alternation (the machine's noise falls on both); tok/s are generated tokens over wall time per
engine, summed over rounds. Also prints how many prompts give identical greedy tokens (generation
runs to `--tokens`, EOS ignored) and, where they differ, the gap between the two top logits in
transformers' full forward at the first difference (a tie or near-tie in that dtype, or not).
"""
from __future__ import annotations

import argparse
import time

import torch

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain speculative decoding in one paragraph.",
    "List three uses of a paperclip.",
    "Summarise: The cat sat on the mat because it was warm in the sun.",
    "What is 12 times 13?",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from draftwise import LLM, SamplingParams
    from draftwise.paths import resolve_model
    from draftwise.model.chat_template import ChatTemplate

    logging.set_verbosity_error()
    path = resolve_model(args.model)
    llm = LLM(path, dtype=args.dtype)
    chat = ChatTemplate(llm.engine.target.tokenizer_config)
    prompts = [llm.tokenizer.encode(chat.render([{"role": "user", "content": q}]), add_special_tokens=False).ids
               for q in QUESTIONS]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype)).eval()
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def run_hf(p, n):
        x = torch.tensor([p])
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        return out[0, len(p):].tolist()

    llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # warm-up
    run_hf(prompts[0], 16)
    secs = {"draftwise": 0.0, "transformers": 0.0}
    toks = {"draftwise": 0, "transformers": 0}
    outs = {}
    for _ in range(args.rounds):
        for i, p in enumerate(prompts):
            t0 = time.perf_counter()
            ours = llm.generate(p, sp)[0].token_ids
            secs["draftwise"] += time.perf_counter() - t0
            toks["draftwise"] += len(ours)
            t0 = time.perf_counter()
            ref = run_hf(p, args.tokens)
            secs["transformers"] += time.perf_counter() - t0
            toks["transformers"] += len(ref)
            outs[i] = (ours, ref)

    print(f"{path}, dtype {args.dtype}, threads {args.threads}, batch 1, {len(prompts)} chat prompts x "
          f"{args.rounds} rounds, {args.tokens} greedy tokens")
    rate = {k: toks[k] / secs[k] for k in secs}
    for k, v in rate.items():
        print(f"  {k:14s} {v:8.1f} tok/s")
    print(f"  draftwise / transformers: {rate['draftwise'] / rate['transformers']:.2f}x")
    same = 0
    for i, (ours, ref) in outs.items():
        d = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if d is None:
            same += 1
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([prompts[i] + ref[:d]])).logits[0, -1].float()
        top = logits.topk(2).values
        print(f"  prompt {i}: first difference at output {d} (transformers' top-2 logit gap "
              f"{float(top[0] - top[1]):.4g})")
    print(f"  identical greedy tokens: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
