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
    return p


def run(args) -> int:
    from ..model.gguf_import import import_gguf

    t0 = time.perf_counter()
    out = import_gguf(args.file, args.out, dtype=args.dtype)
    print(f"draftwise import-gguf: {args.file} -> {out} ({args.dtype}, {time.perf_counter() - t0:.1f} s)",
          file=sys.stderr)
    return 0
