"""bfloat16 ties on a large vocabulary: the LM head in bfloat16 vs float32, against float32 greedy.

    .venv/bin/python benchmarks/bf16_head.py     # needs models/smollm2 (make smollm2)

For six chat prompts, the float32 model's 64 greedy tokens are scored by the bfloat16 model's full
forward; at each position it counts exact ties of the two top logits and agreement with the
float32 argmax, with the bfloat16 LM head and with a float32 copy of it on the same bfloat16
hidden states; then times one decode step with each head (1 thread, median of 5 means of 20).
Measurement only: the engine's compute_logits is patched here, not changed.
"""
from __future__ import annotations

import sys
import time

import torch

sys.path.insert(0, "benchmarks")


def median_ms(fn, n=20, reps=5) -> float:
    ms = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ms.append((time.perf_counter() - t0) / n * 1e3)
    return sorted(ms)[reps // 2]


def main():
    from plain_vs_transformers import QUESTIONS

    from draftwise import LLM, SamplingParams
    from draftwise.model.llama import PackedLinear
    from draftwise.model.chat_template import ChatTemplate

    torch.set_num_threads(1)
    b = LLM("smollm2", dtype="bfloat16", kv_cache_memory="600MB")
    f = LLM("smollm2", dtype="float32", kv_cache_memory="600MB")
    chat = ChatTemplate(b.engine.target.tokenizer_config)
    prompts = [b.tokenizer.encode(chat.render([{"role": "user", "content": q}]), add_special_tokens=False).ids
               for q in QUESTIONS]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    mb, mf = b.engine.target.model, f.engine.target.model
    head32 = PackedLinear([mb.model.embed_tokens.weight.float()])  # SmolLM2 ties the head to the embedding
    stats = dict(positions=0, tie_bf16=0, tie_f32head=0, agree_bf16=0, agree_f32head=0)
    with torch.inference_mode():
        for p in prompts:
            ref = f.generate(p, sp)[0].token_ids  # float32 greedy
            ids = torch.tensor([p + ref])
            hb = mb.forward(ids)[0, len(p) - 1: -1]  # [64, hidden] before each generated token
            want = mf.logits(ids)[0, len(p) - 1: -1].argmax(-1)
            for name, lg in (("bf16", mb.compute_logits(hb)), ("f32head", head32(hb.float()))):
                top2 = lg.topk(2).values
                stats["tie_" + name] += int((top2[:, 0] == top2[:, 1]).sum())
                stats["agree_" + name] += int((lg.argmax(-1) == want).sum())
            stats["positions"] += len(ref)
    print(stats)
    r = b.engine.runner
    r.kv.reserve(7, 200)
    r.run([7], [prompts[0]], [0], [1])
    base = median_ms(lambda: r.run([7], [[5]], [40], [1]))
    orig = type(mb).compute_logits
    type(mb).compute_logits = lambda self, h: head32(h.float())
    f32h = median_ms(lambda: r.run([7], [[5]], [40], [1]))
    type(mb).compute_logits = orig
    print(f"bf16 step {base:.2f} ms, with float32 LM head {f32h:.2f} ms ({f32h / base:.2f}x)")


if __name__ == "__main__":
    main()
