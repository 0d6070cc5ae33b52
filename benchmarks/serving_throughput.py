"""Serving throughput: batching gain without speculation, and the server's overhead with it.

    .venv/bin/python benchmarks/serving_throughput.py [--model DIR --draft DIR] [--tokens 64]
        [--concurrency 16] [--k 4] [--threads 2] [--requests 4] [--json]

1. Speculation off: aggregate decode tokens/s of the engine (`LLM.generate`) with 1 sequence and
   with `--concurrency` sequences running together (short prompts, `ignore_eos`, fixed
   max_tokens): how much batching multiplies throughput.
2. Speculation on (draft model, K = `--k`, temperature 0), concurrency 1: tokens/s through a live
   `draftwise serve` process (the openai-style HTTP API, non-streamed, one request at a time) vs
   `LLM.generate` in this process on the same prompts, the two alternating prompt by prompt (the
   machine's noise falls on both alike): what the HTTP layer costs.

Without --model it uses the embedded pair (models/target, models/draft) when they exist, else
tiny random models built like the tests' (and says so: those figures mean little).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\ndef list_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "def parse_args(argv):\n    parser = ",
    "for line in open(path):\n",
    "def read_json(path):\n    with open(path) as f:\n",
    "class Node:\n    def __init__(self, value, next=None):\n",
    "def quicksort(xs):\n",
]


def resolve_models(args) -> tuple[str, str, str]:
    from draftwise.paths import default_draft, default_target

    if args.model:
        return args.model, args.draft or args.model, "given"
    t, d = default_target(), default_draft()
    if (t / "config.json").is_file() and (d / "config.json").is_file():
        return str(t), str(d), "embedded (models/)"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import make_model_dir, make_tokenizer

    root = Path(tempfile.mkdtemp(prefix="dw_bench_"))
    tok = make_tokenizer(320)
    make_model_dir(root / "target", seed=0, tokenizer=tok, layers=2, hidden=64)
    make_model_dir(root / "draft", seed=1, tokenizer=tok, layers=1, hidden=32, heads=2, kv_heads=1, inter=64)
    return str(root / "target"), str(root / "draft"), "TINY RANDOM models (models/ not found): figures are not meaningful"


def decode_rate(llm, n: int, tokens: int) -> float:
    """Aggregate tokens/s of n sequences generated together (prefill included, prompts are short)."""
    from draftwise import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / dt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_vs_generate(spec, target, draft, k, threads, prompts, tokens, dtype):
    """Each prompt once through `spec.generate` (this process) and once through a live `draftwise
    serve` (same models, a subprocess), alternately, so that the machine's noise falls on both
    sides alike. Returns (generate tok/s, server tok/s, generate's outputs, the server's texts)."""
    import httpx

    from draftwise import SamplingParams

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "draftwise.cli.main", "serve", "--model", target, "--draft", draft,
           "--method", "draft", "--k", str(k), "--port", str(port), "--threads", str(threads),
           "--dtype", dtype, "--served-model-name", "bench", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    try:
        deadline = time.time() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("draftwise serve did not start")
            time.sleep(0.2)
        sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        with httpx.Client(base_url=url, timeout=600) as c:
            body = {"model": "bench", "temperature": 0, "ignore_eos": True}
            c.post("/v1/completions", json=dict(body, prompt=prompts[0], max_tokens=4))  # warm-up
            spec.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            outs, texts = [], []
            t_gen = t_srv = 0.0
            n_gen = n_srv = 0
            for p in prompts:
                t0 = time.perf_counter()
                o = spec.generate(p, sp)[0]
                t_gen += time.perf_counter() - t0
                outs.append(o)
                n_gen += len(o.token_ids)
                t0 = time.perf_counter()
                r = c.post("/v1/completions", json=dict(body, prompt=p, max_tokens=tokens)).json()
                t_srv += time.perf_counter() - t0
                texts.append(r["choices"][0]["text"])
                n_srv += r["usage"]["completion_tokens"]
            return n_gen / t_gen, n_srv / t_srv, outs, texts
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=4, help="sequential requests in part 2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from draftwise import LLM, SpecConfig

    target, draft, which = resolve_models(args)
    print(f"models: {which}\n  target={target}\n  draft={draft}", file=sys.stderr)
    res = {"models": which, "threads": args.threads, "tokens": args.tokens}

    plain = LLM(target, dtype=args.dtype)
    r1 = decode_rate(plain, 1, args.tokens)
    rn = decode_rate(plain, args.concurrency, args.tokens)
    res.update(plain_tok_s_1=r1, **{f"plain_tok_s_{args.concurrency}": rn}, batching_gain=rn / r1)
    print(f"[1] speculation off: {r1:8.1f} tok/s at 1 seq, {rn:8.1f} tok/s at {args.concurrency} seqs "
          f"-> {rn / r1:.2f}x")
    del plain

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    spec = LLM(target, draft=draft, spec=SpecConfig(method="draft", k=args.k), dtype=args.dtype)
    gen, srv, outs, texts = server_vs_generate(spec, target, draft, args.k, args.threads, prompts, args.tokens,
                                               args.dtype)
    mal = sum(o.stats.committed_in_rounds for o in outs) / max(1, sum(o.stats.rounds for o in outs))
    same = texts == [o.text for o in outs]
    res.update(generate_tok_s=gen, server_tok_s=srv, server_vs_generate=srv / gen, mean_accepted_length=mal,
               same_text=same)
    print(f"[2] draft k={args.k}, concurrency 1: LLM.generate {gen:8.1f} tok/s, server {srv:8.1f} tok/s "
          f"-> {srv / gen:.1%} of generate; mean accepted length {mal:.2f}; same text: {same}")
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
