"""llama.cpp beside draftwise: batch-1 greedy decoding on the same prompts, same threads, plain
and (with a draft) speculative.

    .venv/bin/python benchmarks/peer_llamacpp.py [--llamacpp DIR_OR_BINARY] [--gguf FILE]
        [--model smollm2] [--dtype float32,bfloat16] [--tokens 128] [--threads 2] [--rounds 2]
        [--workload NAME --prompts 4] [--draft DIR --draft-gguf FILE --k 4]

With `--draft` (a draftwise draft directory) and `--draft-gguf` (the same draft converted to
GGUF), both engines also decode speculatively with it, k proposals a round: llama.cpp's
`llama-speculative-simple` (draft-simple, n-min 0, p-min 0: every round drafts k, like draftwise's
fixed policy; its rate is its own "decoded N tokens in S seconds" line, after the prompt) and
draftwise's `SpecConfig(method="draft", k=K)`, in the dtype of each run (the draft's GGUF should be
converted in the same dtype as the target's: one llama.cpp run per invocation). The summary
prints draftwise's speculative rate over llama.cpp's best setting (plain or speculative).
`--workload` takes the prompts from a draftwise workload (e.g. code-easy: held-out code for the
embedded pair) instead of the chat questions.

llama.cpp is a benchmark-only peer, never a dependency: its `llama-completion` binary is found
through `--llamacpp` or `$LLAMACPP` (a binary, or a build folder holding `bin/llama-completion`),
else `~/.cache/draftwise/llamacpp/build`; without one the script says so and exits 0 (skipped).
Build recipe: /work/shared/peers/README.md (llama.cpp from the llama-cpp-python sdist, ~11 min on
2 cores). The GGUF (default: SmolLM2-135M-Instruct.Q4_1.gguf in draftwise's cache, the file
`make smollm2` imported) runs natively in llama.cpp (Q4_1 layers, a Q8_0 embedding/head);
draftwise runs the imported, dequantised directory in float32 or bfloat16.

Each round runs every prompt once in llama.cpp and once per draftwise dtype, in alternation (the
machine's noise falls on all). Prompts: a few chat questions rendered with the model's chat
template, fed to both as raw text (`-no-cnv`). llama.cpp's rate is its own decode timing (the
`eval time` perf line: tokens after the first over their time); draftwise's is the same quantity,
(tokens - 1) / (time after the first token), from the engine's step timestamps. Also printed: the
weight bytes each engine reads per token (every weight once; the tied embedding is the LM head)
and the rate times those bytes, "weight GB/s": how well each engine turns memory traffic into
tokens, the fair comparison across 4.5 and 32 bits a weight.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantization import decode  # noqa: E402  (the engine stepped by hand, timestamps per step)

QUESTIONS = [
    "Explain what a Python dictionary is, with an example.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarise the rules of chess in a few sentences.",
]
DEFAULT_BUILD = Path.home() / ".cache" / "draftwise" / "llamacpp" / "build"
DEFAULT_GGUF = Path.home() / ".cache" / "draftwise" / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
EVAL_LINE = re.compile(r"eval time =\s*([\d.]+) ms /\s*(\d+) (?:runs|tokens)")
DECODED_LINE = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")


def find_binary(given: str | None) -> Path | None:
    for cand in (given, os.environ.get("LLAMACPP"), str(DEFAULT_BUILD)):
        if not cand:
            continue
        p = Path(cand).expanduser()
        for b in (p, p / "bin" / "llama-completion", p / "llama-completion"):
            if b.is_file() and os.access(b, os.X_OK):
                return b
        if cand == given:  # named explicitly and not found: say so rather than fall through
            raise SystemExit(f"--llamacpp: no llama-completion binary at {given}")
    return shutil.which("llama-completion") and Path(shutil.which("llama-completion"))


def gguf_weight_bytes(path: Path) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def run_llamacpp(cmd: list[str], prompt: str, parse):
    """Run a llama.cpp tool on `prompt` (given as `-f FILE`) and parse its stderr; its log thread can
    lose the last lines at exit (rc 0, no perf line), so a run whose stderr `parse` finds nothing
    in is repeated, up to 3 times."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    try:
        for _ in range(3):
            r = subprocess.run(cmd + ["-f", f.name], capture_output=True, text=True, timeout=600,
                               stdin=subprocess.DEVNULL)
            got = parse(r.stderr)
            if r.returncode != 0 or got is not None:
                break
    finally:
        os.unlink(f.name)
    if r.returncode != 0 or got is None:
        raise RuntimeError(f"{Path(cmd[0]).name} failed (rc {r.returncode}): {r.stderr[-800:]}")
    return got


def llamacpp_decode(binary: Path, gguf_path: Path, prompt: str, tokens: int, threads: int) -> tuple[int, float]:
    """(decoded tokens after the first, their seconds) from llama.cpp's perf lines."""
    def parse(err: str):
        evals = [m for line in err.splitlines() if "prompt eval" not in line for m in [EVAL_LINE.search(line)] if m]
        return (int(evals[-1].group(2)), float(evals[-1].group(1)) / 1e3) if evals else None

    return run_llamacpp([str(binary), "-m", str(gguf_path), "-n", str(tokens), "--ignore-eos", "--temp", "0",
                         "-t", str(threads), "-tb", str(threads), "-c", "1024", "-no-cnv", "--no-display-prompt",
                         "--perf", "--no-warmup"], prompt, parse)


def llamacpp_speculative(binary: Path, gguf_path: Path, draft_gguf: Path, prompt: str, tokens: int,
                         threads: int, k: int) -> tuple[int, float]:
    """(decoded tokens, their seconds) of llama-speculative-simple (its own timing, after the prompt)."""
    def parse(err: str):
        m = DECODED_LINE.search(err)
        return (int(m.group(1)), float(m.group(2))) if m else None

    return run_llamacpp([str(binary), "-m", str(gguf_path), "-md", str(draft_gguf), "-n", str(tokens),
                         "--ignore-eos", "--temp", "0", "-t", str(threads), "-tb", str(threads), "-td", str(threads),
                         "-tbd", str(threads), "-c", "1024", "--spec-type", "draft-simple", "--spec-draft-n-max",
                         str(k), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"], prompt, parse)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llamacpp", default=None, help="llama-completion binary or llama.cpp build folder (or $LLAMACPP)")
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    ap.add_argument("--model", default="smollm2", help="the draftwise directory imported from the same GGUF")
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workload", default=None, help="prompts from this draftwise workload instead of chat questions")
    ap.add_argument("--prompts", type=int, default=4, help="how many of the workload's prompts")
    ap.add_argument("--draft", default=None, help="draftwise draft directory: speculative runs too")
    ap.add_argument("--draft-gguf", type=Path, default=None, help="the same draft as GGUF, for llama.cpp")
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    if (args.draft is None) != (args.draft_gguf is None):
        ap.error("--draft and --draft-gguf go together")
    if args.draft_gguf is not None and not args.draft_gguf.is_file():
        ap.error(f"--draft-gguf: no such file: {args.draft_gguf}")
    binary = find_binary(args.llamacpp)
    if binary is None:
        print("skipped: no llama-completion (pass --llamacpp or set $LLAMACPP; recipe in /work/shared/peers/README.md)")
        return 0
    if not args.gguf.is_file():
        print(f"skipped: GGUF not found: {args.gguf} (make smollm2 downloads it)")
        return 0
    torch.set_num_threads(args.threads)
    from draftwise import LLM
    from draftwise.model.chat_template import ChatTemplate

    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    llms = {d: LLM(args.model, dtype=d, kv_cache_memory="600MB") for d in dtypes}
    spec_binary = binary.parent / "llama-speculative-simple"
    if args.draft is not None:
        from draftwise import SpecConfig

        if not spec_binary.is_file():
            raise SystemExit(f"--draft: no llama-speculative-simple beside {binary}")
        for d in dtypes:
            llms[f"{d} spec"] = LLM(args.model, dtype=d, kv_cache_memory="600MB", draft=args.draft,
                                    spec=SpecConfig(method="draft", k=args.k, policy="fixed"))
    any_llm = next(iter(llms.values()))
    if args.workload is not None:
        from draftwise.lab.workload import load_workload

        try:
            texts = [r.prompt for r in load_workload(args.workload).requests[: args.prompts]]
        except (ValueError, OSError) as e:
            ap.error(f"--workload: {e}")
    else:
        chat = ChatTemplate(any_llm.engine.target.tokenizer_config)
        texts = [chat.render([{"role": "user", "content": q}]) for q in QUESTIONS]
    ids = [any_llm.tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    for llm in llms.values():
        decode(llm, ids[0], 16)  # warm-up
    llamacpp_decode(binary, args.gguf, texts[0], 16, args.threads)
    engines = ["llama.cpp"] + (["llama.cpp spec"] if args.draft else []) + [f"draftwise {d}" for d in llms]
    n = {e: 0 for e in engines}
    s = {e: 0.0 for e in engines}
    for _ in range(args.rounds):
        for text, p in zip(texts, ids):
            for e in engines:
                if e == "llama.cpp":
                    k, sec = llamacpp_decode(binary, args.gguf, text, args.tokens, args.threads)
                elif e == "llama.cpp spec":
                    k, sec = llamacpp_speculative(spec_binary, args.gguf, args.draft_gguf, text, args.tokens,
                                                  args.threads, args.k)
                else:
                    k, sec = decode(llms[e.split(" ", 1)[1]], p, args.tokens)
                n[e] += k
                s[e] += sec
    wbytes = {"llama.cpp": gguf_weight_bytes(args.gguf)}
    wbytes["llama.cpp spec"] = wbytes["llama.cpp"]  # (the target's: the draft's weights are read per draft step)
    for d, llm in llms.items():
        cfg = llm.engine.target.config
        params = cfg.vocab_size * cfg.hidden_size  # the head (the tied embedding; PackedEmbedding has no parameter)
        for w in llm.engine.target.model.plan:
            params += sum(t.numel() for t in (w.ln1, w.ln2))
        for layer in llm.engine.target.model.model.layers:
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                params += lin.in_features * lin.out_features
        params += cfg.hidden_size  # final norm
        wbytes[f"draftwise {d}"] = params * torch.finfo(getattr(torch, d.split()[0])).bits // 8
    print(f"{args.gguf.name} (llama.cpp {binary}) vs {args.model}; batch 1, greedy, {args.tokens} tokens, "
          f"{len(texts)} {args.workload or 'chat'} prompts x {args.rounds} rounds, {args.threads} threads"
          + (f", speculative: draft k={args.k}" if args.draft else ""))
    rate = {e: n[e] / s[e] for e in engines}
    for e in engines:
        gbs = rate[e] * wbytes[e] / 1e9
        print(f"  {e:20s} {rate[e]:7.1f} tok/s  weights {wbytes[e] / 1e6:6.1f} MB/token  {gbs:5.2f} weight GB/s")
    for e in engines[1:]:
        print(f"  {e} / llama.cpp: {rate[e] / rate['llama.cpp']:.2f}x tok/s, "
              f"{rate[e] * wbytes[e] / (rate['llama.cpp'] * wbytes['llama.cpp']):.2f}x weight GB/s")
    if args.draft is not None:
        best = max(("llama.cpp", "llama.cpp spec"), key=lambda e: rate[e])
        for d in dtypes:
            e = f"draftwise {d} spec"
            print(f"  {e} / llama.cpp's best ({best}, {rate[best]:.1f} tok/s): {rate[e] / rate[best]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
