"""`draftwise generate PROMPT...`: complete prompts, with or without speculation."""
from __future__ import annotations

import json
import sys

from ..sampling import SamplingParams
from .common import add_model_args, add_multi_step_arg, build_llm, check_text


def add_parser(sub):
    p = sub.add_parser("generate", help="complete prompts with or without speculation")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    add_model_args(p)
    add_multi_step_arg(p)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy; below 1e-5 greedy too (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed of sampling (default: none, a fresh draw each run)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    c = p.add_mutually_exclusive_group()  # structured output (xgrammar)
    c.add_argument("--json-schema", metavar="FILE", help="constrain the output to JSON matching this JSON Schema")
    c.add_argument("--regex", metavar="R", help="constrain the output to match this regular expression")
    c.add_argument("--choice", metavar="A,B,C", help="constrain the output to one of these comma-separated strings")
    c.add_argument("--grammar", metavar="FILE", help="constrain the output to this EBNF (GBNF) grammar")
    return p


def structured_output(args) -> tuple[str | None, dict | None]:
    """(the option, SamplingParams.structured_output) from --json-schema/--regex/--choice/--grammar."""
    if args.json_schema:
        with open(args.json_schema, encoding="utf-8") as f:
            return "--json-schema", {"json_schema": f.read()}
    if args.grammar:
        with open(args.grammar, encoding="utf-8") as f:
            return "--grammar", {"grammar": f.read()}
    if args.regex is not None:
        return "--regex", {"regex": check_text(args.regex, "--regex")}
    if args.choice is not None:
        return "--choice", {"choice": check_text(args.choice, "--choice").split(",")}
    return None, None


def run(args) -> int:
    for i, prompt in enumerate(args.prompts, 1):
        check_text(prompt, f"PROMPT {i}")
    for s in args.stop or []:
        check_text(s, "--stop")
    option, constraint = structured_output(args)
    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos, structured_output=constraint,
        )
    except ValueError as e:
        raise ValueError(f"{option}: {e}" if option and str(e).startswith("structured_output") else str(e)) from None
    llm = build_llm(args)
    outs = llm.generate(list(args.prompts), params)
    for prompt, o in zip(args.prompts, outs):
        if args.json:
            print(json.dumps(o.to_dict()))
        else:
            s = o.stats
            print(prompt + o.text)
            print(
                f"[{len(o.token_ids)} tokens, finish={o.finish_reason}, rounds={s.rounds}, "
                f"mean accepted length={s.mean_accepted_length:.2f}, "
                f"{len(o.token_ids) / max(s.total_seconds, 1e-9):.1f} tok/s]",
                file=sys.stderr,
            )
    return 0
