"""dw_gemm_f32 against oneDNN's packed float32 product, side by side in one run.

    .venv/bin/python benchmarks/native_gemm.py products [--layers 30] [--rows 1,2,3,5,9,16,64,256]
        [--shapes smollm2|target]
    .venv/bin/python benchmarks/native_gemm.py decode [--model models/target] [--draft models/draft]
        [--rounds 2] [--tokens 128] [--switch DRAFTWISE_NATIVE_STEP] [--spec ngram]

`products`: SmolLM2-135M-shaped layer products (q/k/v 960x576, o 576x576, gate/up 3072x576, down
576x1536; `--layers` distinct copies, so the weights stream from memory as in decoding), every row
count timed for oneDNN (`torch.ops.mkldnn._linear_pointwise` on its packed weights) and for
dw_gemm_f32, alternating; the results are checked bitwise equal first (close, on an AVX-512 CPU,
where oneDNN sums some shapes in another order). `--shapes target`: the embedded 20M target's 8
layers' shapes (q/k/v 640x384, o 384x384, gate/up 2304x384, down 384x1152; `--layers 8`).
`decode`: batch-1 greedy decoding of a few code prompts by the embedded pair, plain and with the
draft (k=4), each in a subprocess with DRAFTWISE_NATIVE_GEMM=0 (oneDNN) and =1 (dw_gemm_f32) in
alternation, `--rounds` times; `--switch DRAFTWISE_NATIVE_STEP` compares the target's whole step
in one dw_decoder call (=1) against the per-layer path (=0) instead; `--spec ngram` speculates
with n-gram lookup (a model without a draft, e.g. `--model models/smollm2`).
Only where dw_gemm_f32 is used (kernels built; see model/llama.py `native_gemm_wanted`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
TARGET_SHAPES = [(640, 384), (384, 384), (2304, 384), (384, 1152)]
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n",
           "import os\n\ndef list_files(path):\n", "def parse_args(argv):\n"]


def products(layers: int, rows_list: list[int], threads: int, shapes: list[tuple[int, int]] = SHAPES) -> None:
    import torch

    from draftwise.model import cpu_kernels
    from draftwise.model.llama import native_gemm_wanted

    torch.set_num_threads(threads)
    if not native_gemm_wanted():
        raise SystemExit("dw_gemm_f32 is not used on this machine (no kernels, or DRAFTWISE_NATIVE_GEMM=0)")
    k = cpu_kernels.kernels()

    def pack(w):
        wp = torch.empty((w.shape[0] + 15) // 16, w.shape[1], 16)
        k.pack(w.data_ptr(), wp.data_ptr(), *w.shape, 4)
        return wp

    g = torch.Generator().manual_seed(0)
    dnn, ours = [], []
    for _ in range(layers):
        ws = [torch.randn(o, n, generator=g) for o, n in shapes]
        dnn.append([torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws])
        ours.append([pack(w) for w in ws])
    print(f"{layers} layers of {shapes}, {threads} threads; ms per pass over all of them (best of 3)")
    for rows in rows_list:
        xs = [torch.randn(rows, n, generator=g) for _, n in shapes]
        outs = [torch.empty(rows, o) for o, _ in shapes]

        def run_dnn():
            return [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for l in dnn for w, x in zip(l, xs)]

        def run_ours():
            for l in ours:
                for w, x, y, (o, n) in zip(l, xs, outs, shapes):
                    k.gemm_f32(x.data_ptr(), w.data_ptr(), 0, y.data_ptr(), rows, o, n, threads)
            return outs

        ref = run_dnn()[-len(shapes):]
        run_ours()
        same = torch.equal if not cpu_kernels.avx512() else lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-4)
        assert all(same(a, b) for a, b in zip(ref, outs)), "dw_gemm_f32 differs from oneDNN"
        best = {"oneDNN": [], "dw_gemm_f32": []}
        for _ in range(3):
            for name, f in (("oneDNN", run_dnn), ("dw_gemm_f32", run_ours)):
                s = time.perf_counter()
                f()
                best[name].append(time.perf_counter() - s)
        a, b = min(best["oneDNN"]), min(best["dw_gemm_f32"])
        print(f"rows {rows:4d}: oneDNN {a * 1e3:7.1f}  dw_gemm_f32 {b * 1e3:7.1f}  ({a / b:.2f}x)")


def _decode_child(model: str, draft: str | None, tokens: int, threads: int, spec_method: str) -> None:
    import torch

    from draftwise import LLM, SpecConfig
    from draftwise.sampling import SamplingParams

    torch.set_num_threads(threads)
    spec = SpecConfig(method=spec_method, k=4) if draft else None
    if spec_method != "draft":
        draft = None
    llm = LLM(model=model, draft=draft, spec=spec)
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(PROMPTS[:1], sp)  # warm-up
    t, n = time.perf_counter(), 0
    for p in PROMPTS:
        n += len(llm.generate([p], sp)[0].token_ids)
    print(json.dumps({"tok_s": n / (time.perf_counter() - t)}))


def decode(model: str, draft: str, rounds: int, tokens: int, threads: int, switch: str, spec: str) -> None:
    res: dict[tuple[str, str], list[float]] = {}
    name = {"DRAFTWISE_NATIVE_GEMM": ("oneDNN", "dw_gemm_f32"), "DRAFTWISE_NATIVE_STEP": ("per-layer", "one call")}[switch]
    spec_mode = f"{spec} k=4"
    for _ in range(rounds):
        for mode in ("plain", spec_mode):
            for native in ("0", "1"):
                cmd = [sys.executable, __file__, "_child", "--model", model, "--tokens", str(tokens),
                       "--threads", str(threads), "--spec", spec] + (["--draft", draft] if mode != "plain" else [])
                out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                     env=dict(os.environ, **{switch: native}))
                res.setdefault((mode, native), []).append(json.loads(out.stdout.strip().splitlines()[-1])["tok_s"])
    print(f"batch 1, greedy, {len(PROMPTS)} prompts x {tokens} tokens, {threads} threads, {rounds} rounds (tok/s)")
    for mode in ("plain", spec_mode):
        a, b = res[(mode, "0")], res[(mode, "1")]
        print(f"{mode:10s} {name[0]} {' / '.join(f'{v:.1f}' for v in a)}   {name[1]} {' / '.join(f'{v:.1f}' for v in b)}"
              f"   ({sum(b) / sum(a):.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["products", "decode", "_child"])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", default="1,2,3,5,9,16,64,256")
    ap.add_argument("--shapes", default="smollm2", choices=["smollm2", "target"])
    ap.add_argument("--model", default=str(ROOT / "models" / "target"))
    ap.add_argument("--draft", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--switch", default="DRAFTWISE_NATIVE_GEMM", choices=["DRAFTWISE_NATIVE_GEMM", "DRAFTWISE_NATIVE_STEP"],
                    help="what `decode` compares: dw_gemm_f32 against oneDNN, or the one-call step against the per-layer path")
    ap.add_argument("--spec", default="draft", choices=["draft", "ngram"], help="the speculative config of `decode`")
    a = ap.parse_args()
    if a.what == "products":
        products(a.layers, [int(r) for r in a.rows.split(",")], a.threads,
                 TARGET_SHAPES if a.shapes == "target" else SHAPES)
    elif a.what == "decode":
        decode(a.model, a.draft or str(ROOT / "models" / "draft"), a.rounds, a.tokens, a.threads, a.switch, a.spec)
    else:
        _decode_child(a.model, a.draft, a.tokens, a.threads, a.spec)


if __name__ == "__main__":
    main()
