"""The Qwen2.5-Coder pair beside llama.cpp on the same GGUF files: batch 1, greedy, code chat prompts.

    .venv/bin/python benchmarks/qwen_coder_peers.py [--llamacpp BUILD] [--tokens 128] [--threads 2]
        [--rounds 1] [--k 4] [--llamacpp-k 2,3,4,5,6,8] [--configs plain,draft,draft-cheap] [--out FILE.json]

llama.cpp (a benchmark-only peer; build recipe in /work/shared/peers/README.md, found as in
peer_llamacpp.py) runs the two GGUF files `make qwen-coder` joined (~/.cache/draftwise/gguf/):
`llama-completion` plain and `llama-speculative-simple` with the 0.5B draft at each draft length
of `--llamacpp-k` (draft-simple, n-min 0, p-min 0); draftwise runs the directories imported from
the same files: plain, the 0.5B draft at k (`draft`), and the cheaper draft (`draft-cheap`: its
layers int4 and its head over the 32,768 most frequent tokens, `--draft-quantization int4
--draft-vocab 32768`). Every prompt runs on every engine in turn (the machine's noise falls on
all); rates are decode rates after the first token (llama.cpp's own perf lines; draftwise's step
timestamps); prefill is each engine's prompt rate on the 182-token prompt (llama.cpp's `prompt
eval` line; draftwise's seconds to the first token, plain, not in the prefix cache).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_llamacpp import find_binary, llamacpp_decode, llamacpp_speculative, run_llamacpp  # noqa: E402
from qwen_coder_prompts import DRAFT, LONG_PROMPT, PROMPTS, TARGET, render  # noqa: E402
from qwen_coder_speed import CHEAP_VOCAB, decode  # noqa: E402

GGUF = Path(os.environ.get("DRAFTWISE_CACHE", "~/.cache/draftwise")).expanduser() / "gguf"
TARGET_GGUF = GGUF / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DRAFT_GGUF = GGUF / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
PROMPT_LINE = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")


def llamacpp_prefill(binary: Path, prompt: str, threads: int) -> float:
    """llama.cpp's prompt tokens per second (its `prompt eval time` line)."""
    def parse(err: str):
        m = PROMPT_LINE.search(err)
        return int(m.group(2)) / (float(m.group(1)) / 1e3) if m else None

    return run_llamacpp([str(binary), "-m", str(TARGET_GGUF), "-n", "1", "--temp", "0", "-t", str(threads), "-tb",
                         str(threads), "-c", "1024", "-no-cnv", "--no-display-prompt", "--perf", "--no-warmup"],
                        prompt, parse)


def draftwise_engines(configs: list[str], k: int) -> dict:
    from draftwise import LLM, SpecConfig

    small = dict(kv_cache_memory="256MiB", max_model_len=2048)
    kinds = {"plain": dict(spec=SpecConfig(method=None)),
             "draft": dict(draft=DRAFT, spec=SpecConfig(method="draft", k=k)),
             "draft-cheap": dict(draft=DRAFT, spec=SpecConfig(method="draft", k=k), draft_quantization="int4",
                                 draft_vocab=CHEAP_VOCAB)}
    unknown = set(configs) - set(kinds)
    if unknown:
        raise SystemExit(f"--configs: unknown {sorted(unknown)} (choose from {', '.join(kinds)})")
    return {f"draftwise {c}" + (f" k={k}" if c != "plain" else ""): LLM(TARGET, **kinds[c], **small) for c in configs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llamacpp", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--llamacpp-k", default="2,3,4,5,6,8")
    ap.add_argument("--configs", default="plain,draft,draft-cheap")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    binary = find_binary(args.llamacpp)
    if binary is None or not (binary.parent / "llama-speculative-simple").is_file():
        print("skipped: no llama.cpp build (recipe in /work/shared/peers/README.md)")
        return 0
    for f in (TARGET_GGUF, DRAFT_GGUF):
        if not f.is_file():
            print(f"skipped: {f} not found (make qwen-coder joins it)")
            return 0
    torch.set_num_threads(args.threads)
    print(f"load at start: {os.getloadavg()}", flush=True)
    llms = draftwise_engines(args.configs.split(","), args.k)
    tok = next(iter(llms.values())).tokenizer
    texts = [render(TARGET, p) for p in PROMPTS[: args.prompts]]
    ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    spec = binary.parent / "llama-speculative-simple"
    ks = [int(x) for x in args.llamacpp_k.split(",")]
    runs = {"llama.cpp plain": lambda t, p: llamacpp_decode(binary, TARGET_GGUF, t, args.tokens, args.threads)}
    for kk in ks:
        runs[f"llama.cpp spec k={kk}"] = (lambda kk: lambda t, p: llamacpp_speculative(
            spec, TARGET_GGUF, DRAFT_GGUF, t, args.tokens, args.threads, kk))(kk)
    outs: dict[str, list] = {}

    def ours(label, llm):
        def run(text, p):
            out, n_after, sec, _ = decode(llm, p, args.tokens)
            outs.setdefault(label, []).append(out)
            return n_after, sec
        return run

    for label, llm in llms.items():
        decode(llm, ids[0], 8)  # warm-up
        runs[label] = ours(label, llm)
    llamacpp_decode(binary, TARGET_GGUF, texts[0], 8, args.threads)
    n = {e: 0 for e in runs}
    s = {e: 0.0 for e in runs}
    for _ in range(args.rounds):
        for t, p in zip(texts, ids):
            for e, run in runs.items():
                k, sec = run(t, p)
                n[e] += k
                s[e] += sec
    rate = {e: n[e] / s[e] for e in runs}
    best_spec = max((e for e in runs if e.startswith("llama.cpp spec")), key=rate.get)
    plain = outs.get("draftwise plain", [])
    result = {"tokens": args.tokens, "threads": args.threads, "prompts": len(texts), "rounds": args.rounds,
              "decode tok/s": {e: round(r, 2) for e, r in rate.items()}, "best llama.cpp spec": best_spec}
    print(f"batch 1, greedy, {args.tokens} tokens, {len(texts)} code chat prompts x {args.rounds}, "
          f"{args.threads} threads", flush=True)
    for e in runs:
        same = f"  greedy = plain: {outs[e] == plain}" if e in outs and plain else ""
        print(f"  {e:28s} {rate[e]:6.2f} tok/s  {rate[e] / rate['llama.cpp plain']:4.2f}x llama.cpp plain  "
              f"{rate[e] / rate[best_spec]:4.2f}x {best_spec}{same}", flush=True)
    long_text = render(TARGET, LONG_PROMPT)
    if "draftwise plain" in llms:
        long_ids = tok.encode(long_text, add_special_tokens=False).ids
        ttft = decode(llms["draftwise plain"], long_ids, 2)[3]
        result["prefill tok/s"] = {"draftwise": round(len(long_ids) / ttft, 1),
                                   "llama.cpp": round(llamacpp_prefill(binary, long_text, args.threads), 1)}
        print(f"  prefill ({len(long_ids)} tokens): {result['prefill tok/s']}", flush=True)
    print(f"load at end: {os.getloadavg()}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
