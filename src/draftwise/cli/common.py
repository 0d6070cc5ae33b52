"""Arguments shared by subcommands (model, draft, method, k, dtype) and the LLM they build."""
from __future__ import annotations

import argparse

from ..engine import SpecConfig


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target model directory (Hugging Face format); default: the embedded target")
    p.add_argument("--draft", help="draft model directory; default: the embedded draft when --model is not given")
    p.add_argument("--method", default=None, help="speculative method: draft, ngram or none (default: draft)")
    p.add_argument("--k", type=int, default=4, help="proposals per round (default 4)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16"],
                   help="draft model dtype (default: bfloat16 on CPU, else --dtype)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")


def spec_from_args(args) -> SpecConfig:
    method = args.method
    if method is None:
        method = "draft" if (args.draft or not args.model) else "none"
    return SpecConfig(method=None if method == "none" else method, k=args.k)


def build_llm(args):
    import torch

    from ..llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    return LLM(args.model, draft=args.draft, spec=spec_from_args(args), dtype=args.dtype, device=args.device,
               draft_dtype=args.draft_dtype)
