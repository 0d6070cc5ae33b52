"""Where a server's memory goes: load a target (and a draft) the way `draftwise serve` does and
print the resident set after each stage, then run a few requests.

Question it answers: of the peak RSS of `draftwise serve`, how much is the interpreter and torch,
each model's weights, the K/V pools (engine/kv_sizing.py chooses them) and the first steps'
workspace? The peak under real traffic is read from the server's /proc/PID/status (VmHWM) while
`draftwise bench --url` drives it (the command is in benchmarks/results/serve-memory.json).

    .venv/bin/python benchmarks/serve_memory.py --model qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct [--draft-quantization int4 --draft-vocab 32768] \
        [--kv-cache-memory 1GiB] [--requests 16]
"""
from __future__ import annotations

import argparse
import time

from draftwise.server.heap import limit_arenas


def resident() -> str:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 2**20
    return f"RSS {fields['VmRSS']:.2f} GiB, peak {fields['VmHWM']:.2f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--draft-quantization", default=None)
    ap.add_argument("--draft-vocab", type=int, default=None)
    ap.add_argument("--kv-cache-memory", default=None)
    ap.add_argument("--requests", type=int, default=16, help="requests of about 500 prompt tokens run at the end")
    args = ap.parse_args()
    limit_arenas(2)  # as serve does, before any thread allocates
    import torch  # noqa: F401

    from draftwise.engine import LLMEngine
    from draftwise.engine.config import EngineConfig, SpecConfig
    from draftwise.engine.kv_sizing import format_bytes, weight_bytes
    from draftwise.model import pair
    from draftwise.model.pair import load_pair
    from draftwise.sampling.params import SamplingParams

    print(f"python + torch: {resident()}", flush=True)
    loader = pair.load_model

    def load_model(path, **kw):  # each model as load_pair loads it, then the resident set
        t = time.perf_counter()
        loaded = loader(path, **kw)
        print(f"{loaded.path.name} loaded in {time.perf_counter() - t:.1f} s "
              f"({format_bytes(weight_bytes([loaded]))} of weights): {resident()}", flush=True)
        return loaded

    pair.load_model = load_model
    target, draft = load_pair(args.model, args.draft, needs_draft=args.draft is not None, method="draft",
                              draft_quantization=args.draft_quantization, draft_vocab=args.draft_vocab)
    if args.draft_vocab:
        print(f"draft head pruned to {args.draft_vocab} tokens: {resident()}", flush=True)
    spec = SpecConfig(method="draft", k=4) if draft is not None else SpecConfig()
    engine = LLMEngine(target, draft, spec, EngineConfig(kv_cache_memory=args.kv_cache_memory))
    print(f"engine built, {engine.kv_plan.describe()}: {resident()}", flush=True)
    for i in range(args.requests):
        prompt = f"# {i}\n" + "def quicksort(xs):\n" * 80
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=16))
    while engine.has_unfinished():
        engine.step()
    print(f"after {args.requests} requests: {resident()}", flush=True)


if __name__ == "__main__":
    main()
