"""`draftwise check`: certify that a speculative configuration is lossless on your models."""
from __future__ import annotations

from pathlib import Path

from .common import add_model_args, spec_from_args, warn_tokenizer_mismatch


def add_parser(sub):
    p = sub.add_parser("check", help="certify that speculation leaves the output unchanged (exit 1 on any FAIL)",
                       description="Greedy equality, distribution test, KV rollback and stops inside accepted "
                                   "blocks; prints PASS/FAIL per check and exits non-zero on any FAIL.")
    add_model_args(p)
    p.add_argument("--temperature", type=float, default=1.0, help="temperature of the distribution test (default 1)")
    p.add_argument("--prompts", default=None,
                   help="prompts: a workload JSONL (field 'prompt') or a text file with one prompt per line "
                        "(default: the first 6 of the shipped code-easy workload)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    p.add_argument("--samples", type=int, default=400, help="samples per prompt in the distribution test")
    p.add_argument("--horizon", type=int, default=4, help="tokens per sample in the distribution test")
    p.add_argument("--alpha", type=float, default=0.01, help="significance level of the distribution test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None,
                   help="certify a running OpenAI-compatible server (e.g. a speculative vLLM) against "
                        "--reference-url (the same model served plainly): greedy equality and distribution")
    p.add_argument("--reference-url", default=None, help="the reference server for --url")
    p.add_argument("--served-model", default=None, help="model name on --url (default: its first /v1/models)")
    p.add_argument("--reference-model", default=None, help="model name on --reference-url (default: its first)")
    return p


def load_prompts(path: str | None) -> list[str]:
    from ..lab.workload import load_workload, read_jsonl

    if path is None:
        return [r.prompt for r in load_workload("code-easy").requests[:6]]
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--prompts: file not found: {path}")
    if p.suffix == ".jsonl":
        return [r.prompt for r in read_jsonl(p)]
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompts: {path}: not valid UTF-8 text (byte {e.start})") from None
    lines = [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--prompts: no prompts in {path}")
    return lines


def run(args) -> int:
    import torch
    from rich.console import Console

    from ..lab.check import CheckSetup, run_checks
    from ..model.pair import load_pair
    from ..proposers import proposer_class

    if args.threads:
        torch.set_num_threads(args.threads)
    for name in ("max_tokens", "samples", "horizon"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0 for the distribution test, got {args.temperature}")
    if args.url or args.reference_url:
        return _check_servers(args)
    spec = spec_from_args(args)
    if spec.method is None:
        raise ValueError("check needs a speculative method (--method draft or ngram)")
    warn_tokenizer_mismatch(args, "check", [spec.method])
    target, draft = load_pair(args.model, args.draft, needs_draft=proposer_class(spec.method).needs_draft_model,
                              dtype=args.dtype, draft_dtype=args.draft_dtype, device=args.device,
                              method=spec.method, quantization=args.quantization)
    max_len = target.config.max_position_embeddings
    if draft is not None:
        max_len = min(max_len, draft.config.max_position_embeddings)
    budget = max(1, min(256, max_len - 4 * args.max_tokens - spec.k - 2))  # rollback runs 4x max_tokens
    prompts = [target.tokenizer.encode(t).ids[-budget:] for t in load_prompts(args.prompts)]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise ValueError("no non-empty prompts")
    setup = CheckSetup(target, draft, spec, prompts, temperature=args.temperature, max_tokens=args.max_tokens,
                       samples=args.samples, horizon=args.horizon, alpha=args.alpha, seed=args.seed,
                       recurrent_rollback=args.recurrent_rollback)
    console = Console()
    console.print(f"draftwise check: target {target.path}, method {spec.method}, k={spec.k}"
                  + (f", draft {draft.path}" if draft is not None else "") + f", {len(prompts)} prompts")
    results = run_checks(setup, on_start=lambda name: console.print(f"  running {name} ...", style="dim"))
    return _print_results(console, results)


def _check_servers(args) -> int:
    """`--url` against `--reference-url`: greedy equality and the distribution test over HTTP."""
    import httpx
    from rich.console import Console

    from ..lab.certify import certify_servers

    if not (args.url and args.reference_url):
        raise ValueError("--url and --reference-url go together: the server to certify and a plain reference")
    console = Console()
    console.print(f"draftwise check: {args.url} against the reference {args.reference_url}")
    try:
        results = certify_servers(args.url, args.reference_url, load_prompts(args.prompts), max_tokens=args.max_tokens,
                                  samples=args.samples, horizon=args.horizon, temperature=args.temperature,
                                  alpha=args.alpha, seed=args.seed, model=args.served_model,
                                  reference_model=args.reference_model)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the servers: {type(e).__name__}: {e}") from None
    return _print_results(console, results)


def _print_results(console, results) -> int:
    for r in results:
        figs = ", ".join(f"{k}={v}" for k, v in r.figures.items() if v is not None)
        tag = "[green]PASS[/green]" if r.passed else "[red]FAIL[/red]"
        console.print(f"{tag} {r.name}: {figs}" + (f" ({r.detail})" if r.detail else ""))
    failed = [r.name for r in results if not r.passed]
    console.print(f"{len(results) - len(failed)}/{len(results)} checks passed" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
