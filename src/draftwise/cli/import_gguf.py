"""`draftwise import-gguf FILE --out DIR`: a llama.cpp GGUF file -> a Hugging Face model directory."""
from __future__ import annotations

import sys
import time


def add_parser(sub):
    p = sub.add_parser("import-gguf", help="convert a GGUF file (llama, mistral, qwen2, qwen3) to a model directory")
    p.add_argument("file", metavar="FILE", help="the .gguf file")
    p.add_argument("--out", required=True, help="output directory (replaced if it exists)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the dequantised weights (default float32)")
    p.add_argument("--keep-quantized", action="store_true",
                   help="write the quantized projections, embeddings and LM head as blocks, not floats "
                        "(Q4_0/Q4_1/Q4_K as draftwise's int4, Q8_0/Q5_0 as int8 in groups, other types as int8 "
                        "groups from their values: see model/gguf_blocks.py); float tensors stay float")
    return p


def run(args) -> int:
    from ..model.gguf_import import import_gguf

    t0 = time.perf_counter()
    out = import_gguf(args.file, args.out, dtype=args.dtype, keep_quantized=args.keep_quantized)
    kept = ""
    if args.keep_quantized:
        import json

        qc = json.loads((out / "config.json").read_text()).get("quantization_config", {})
        n4, n8 = qc.get("int4_tensors", 0), qc.get("int8_tensors", 0)
        kept = (f", projections kept: {n4} as int4, {n8} as int8 groups" if n4 + n8 else
                ", no quantized projections to keep")
    print(f"draftwise import-gguf: {args.file} -> {out} ({args.dtype}{kept}, {time.perf_counter() - t0:.1f} s)",
          file=sys.stderr)
    return 0
