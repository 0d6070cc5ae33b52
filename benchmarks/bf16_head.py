"""bfloat16 ties on a large vocabulary: the LM head in bfloat16, in float32, or bfloat16 with its
top logits recomputed in float32 (the default, model/head_precision.py), against float32 greedy.

    .venv/bin/python benchmarks/bf16_head.py     # needs models/smollm2 (make smollm2)

For six chat prompts, the float32 model's 64 greedy tokens (transformers' own in float32: the
README's side-by-side run) are scored by the bfloat16 model's full forward; at each position it
counts exact ties of the two top logits and agreement with the float32 argmax, for the bfloat16
head (`bf16`), a float32 copy of it on the same bfloat16 hidden states (`f32head`), the float32
final norm and head on the bfloat16 residual stream (`f32norm+head`) and the refined bfloat16 head
(`refined`). Then free-running: the first output where bfloat16 greedy decoding leaves the float32
tokens, without and with the refinement. Then times one decode step per head (1 thread, median of
5 means of 20). The heads other than the model's own are patched in here.
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
    norm_w = mb.model.norm.weight.float()
    eps = mb.cfg.rms_norm_eps
    variants = ("bf16", "f32head", "f32norm+head", "refined")
    stats = {"positions": 0, **{f"{k}_{v}": 0 for v in variants for k in ("tie", "agree")}}
    diverge = {"bf16": [], "refined": []}
    with torch.inference_mode():
        for p in prompts:
            ref = f.generate(p, sp)[0].token_ids  # float32 greedy
            ids = torch.tensor([p + ref])
            mb.refine_head = False
            hb = mb.forward(ids)[0, len(p) - 1: -1]  # [64, hidden] before each generated token
            want = mf.logits(ids)[0, len(p) - 1: -1].argmax(-1)
            # the residual stream before the final norm (the layers again, PyTorch path, no cache)
            x = mb.model.embed_tokens(ids)
            cos, sin = mb.rope(torch.arange(ids.shape[1])[None])
            for layer in mb.model.layers:
                x = layer(x, cos, sin)
            x = x[0, len(p) - 1: -1].float()  # [64, hidden]
            hn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_w
            mb.refine_head = True
            for name, lg in (("bf16", mb.lm_head(hb).float()), ("f32head", head32(hb.float())),
                             ("f32norm+head", head32(hn)), ("refined", mb.compute_logits(hb))):
                top2 = lg.topk(2).values
                stats["tie_" + name] += int((top2[:, 0] == top2[:, 1]).sum())
                stats["agree_" + name] += int((lg.argmax(-1) == want).sum())
            stats["positions"] += len(ref)
            for name in diverge:
                mb.refine_head = name == "refined"
                out = b.generate(p, sp)[0].token_ids
                diverge[name].append(next((i for i, (u, v) in enumerate(zip(out, ref)) if u != v), None))
    print(stats)
    print("first output leaving float32 greedy (None: all 64 equal):", diverge)
    r = b.engine.runner
    r.kv.reserve(7, 200)
    r.run([7], [prompts[0]], [0], [1])
    times = {}
    for name in ("bf16", "refined", "f32head"):
        mb.refine_head = name == "refined"
        if name == "f32head":
            type(mb).compute_logits = lambda self, h: head32(h.float())
        times[name] = median_ms(lambda: r.run([7], [[5]], [40], [1]))
    print("decode step, 1 thread: " + ", ".join(f"{k} {v:.2f} ms ({v / times['bf16']:.2f}x)" for k, v in times.items()))

if __name__ == "__main__":
    main()
