"""`draftwise check`: certify that a speculative configuration is lossless on your models."""
from __future__ import annotations

import textwrap
from contextlib import contextmanager
from pathlib import Path

from .common import METHOD_HELP_CHECK, add_model_args, add_progress_arg, draft_load_args, spec_from_args


# --quick: a run of well under a minute on the embedded pair, for a first look; the price is power
# (the distribution test then sees only biases about twice as large; see docs/cli.md)
DEFAULTS = {"samples": 400, "horizon": 4, "max_tokens": 32, "prompts": 6}
QUICK = {"samples": 100, "horizon": 2, "max_tokens": 16, "prompts": 3}


def add_parser(sub):
    p = sub.add_parser("check", help="certify that speculation leaves the output unchanged (exit 1 on any FAIL)",
                       description="Greedy equality, distribution test, KV rollback and stops inside accepted "
                                   "blocks; prints PASS/FAIL per check with what it measured and why, and exits "
                                   "non-zero on any FAIL.")
    add_model_args(p, method_help=METHOD_HELP_CHECK)
    p.add_argument("--temperature", type=float, default=1.0, help="temperature of the distribution test (default 1)")
    p.add_argument("--prompts", default=None,
                   help="prompts: a workload JSONL (field 'prompt') or a text file with one prompt per line "
                        "(default: the first 6 of the shipped code-easy workload; --quick: the first 3); the "
                        "distribution test uses the first 3")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"greedy tokens per prompt (default {DEFAULTS['max_tokens']}; --quick: {QUICK['max_tokens']})")
    p.add_argument("--samples", type=int, default=None,
                   help=f"samples per prompt and per side in the distribution test (default {DEFAULTS['samples']}; "
                        f"--quick: {QUICK['samples']})")
    p.add_argument("--horizon", type=int, default=None,
                   help=f"tokens per sample in the distribution test, each position tested apart (default "
                        f"{DEFAULTS['horizon']}; --quick: {QUICK['horizon']})")
    p.add_argument("--alpha", type=float, default=0.01,
                   help="significance level of the distribution test: a lossless sampler fails it in at most this "
                        "share of runs (default 0.01)")
    p.add_argument("--seed", type=int, default=0, help="first seed of the sampled requests (default 0)")
    p.add_argument("--quick", action="store_true",
                   help=f"a first look in well under a minute on the embedded pair: {QUICK['prompts']} prompts, "
                        f"{QUICK['max_tokens']} greedy tokens, {QUICK['samples']} samples of {QUICK['horizon']} "
                        "tokens; the distribution test then catches only about twice as large a bias (options "
                        "given explicitly win)")
    add_progress_arg(p, "requests done / planned")
    p.add_argument("--url", default=None,
                   help="certify a running OpenAI-compatible server (e.g. a speculative vLLM) against "
                        "--reference-url (the same model served plainly): greedy equality and distribution")
    p.add_argument("--reference-url", default=None, help="the reference server for --url")
    p.add_argument("--served-model", default=None, help="model name on --url (default: its first /v1/models)")
    p.add_argument("--reference-model", default=None, help="model name on --reference-url (default: its first)")
    return p


def _resolve(args) -> None:
    """Fill the options left out from the defaults (or --quick's), then check their ranges."""
    preset = QUICK if args.quick else DEFAULTS
    for name in ("max_tokens", "samples", "horizon"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0 for the distribution test, got {args.temperature}")
    if not 0 < args.alpha < 1:
        raise ValueError(f"--alpha must be in (0, 1), got {args.alpha}")


def load_prompts(path: str | None, default_count: int = DEFAULTS["prompts"]) -> list[str]:
    from ..lab.workload import load_workload, read_jsonl

    if path is None:
        return [r.prompt for r in load_workload("code-easy").requests[:default_count]]
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

    from ..lab.check import STOPS_MAX_TOKENS, CheckSetup, planned_requests, run_checks
    from ..model.pair import load_pair
    from ..proposers import proposer_class

    if args.threads:
        torch.set_num_threads(args.threads)
    _resolve(args)
    if args.url or args.reference_url:
        return _check_servers(args)
    spec = spec_from_args(args)
    if spec.method is None:
        raise ValueError("check needs a speculative method: --method ngram, or --method draft with --draft "
                         "(with --model alone the method defaults to none)")
    target, draft = load_pair(args.model, args.draft, needs_draft=proposer_class(spec.method).needs_draft_model,
                              dtype=args.dtype, draft_dtype=args.draft_dtype, device=args.device,
                              method=spec.method, quantization=args.quantization, **draft_load_args(args))
    max_len = target.config.max_position_embeddings
    if draft is not None:
        max_len = min(max_len, draft.config.max_position_embeddings)
    # room after each prompt for the longest output a check asks for: rollback runs 4x max_tokens
    budget = max(1, min(256, max_len - max(4 * args.max_tokens, STOPS_MAX_TOKENS) - spec.k - 2))
    texts = load_prompts(args.prompts, (QUICK if args.quick else DEFAULTS)["prompts"])
    prompts = [p for p in (target.tokenizer.encode(t).ids[-budget:] for t in texts) if p]
    if not prompts:
        raise ValueError("no non-empty prompts")
    setup = CheckSetup(target, draft, spec, prompts, temperature=args.temperature, max_tokens=args.max_tokens,
                       samples=args.samples, horizon=args.horizon, alpha=args.alpha, seed=args.seed,
                       recurrent_rollback=args.recurrent_rollback, prefix_caching=args.prefix_caching,
                       kv_cache_memory=args.kv_cache_memory)
    console = Console()
    console.print(f"draftwise check: target {target.path}, method {spec.method}, k={spec.k}"
                  + (f", draft {draft.path}" if draft is not None else "") + f", {len(prompts)} prompts"
                  + (" (--quick)" if args.quick else ""), soft_wrap=True)
    with _bar(args, sum(planned_requests(setup).values())) as (on_start, on_done):
        results = run_checks(setup, on_start=on_start, on_done=on_done)
    return _print_results(console, results)


@contextmanager
def _bar(args, total: int):
    """(on_start, on_done) callbacks drawing a bar of requests on stderr (lab/progress.py)."""
    from ..lab.progress import make_progress, stderr_console

    with make_progress(stderr_console(args.progress), args.progress, transient=True) as bar:
        task = bar.add_task("check", total=total)
        yield (lambda name: bar.update(task, description=name)), (lambda: bar.advance(task))


def _check_servers(args) -> int:
    """`--url` against `--reference-url`: greedy equality and the distribution test over HTTP."""
    import httpx
    from rich.console import Console

    from ..lab.certify import certify_servers, planned_server_requests

    if not (args.url and args.reference_url):
        raise ValueError("--url and --reference-url go together: the server to certify and a plain reference")
    console = Console()
    console.print(f"draftwise check: {args.url} against the reference {args.reference_url}"
                  + (" (--quick)" if args.quick else ""), soft_wrap=True)
    prompts = load_prompts(args.prompts, (QUICK if args.quick else DEFAULTS)["prompts"])
    try:
        with _bar(args, planned_server_requests(len(prompts), args.samples)) as (on_start, on_done):
            results = certify_servers(args.url, args.reference_url, prompts, max_tokens=args.max_tokens,
                                      samples=args.samples, horizon=args.horizon, temperature=args.temperature,
                                      alpha=args.alpha, seed=args.seed, model=args.served_model,
                                      reference_model=args.reference_model, on_start=on_start, on_done=on_done)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the servers: {type(e).__name__}: {e}") from None
    return _print_results(console, results)


def _print_results(console, results) -> int:
    """Per result: PASS/FAIL, its name and deciding figures on one line, then what it measured,
    its threshold and why (lab/check_explain.py), indented."""
    from rich.markup import escape

    from ..lab.check_explain import explain

    for r in results:
        head, lines = explain(r)
        tag = "[green]PASS[/green]" if r.passed else "[red]FAIL[/red]"
        console.print(f"{tag} {r.name}: " + escape(head), soft_wrap=True)
        for line in lines:
            console.print(textwrap.fill(line, width=min(console.width, 100), initial_indent="    ",
                                        subsequent_indent="    "), markup=False, highlight=False, soft_wrap=True)
    failed = [r.name for r in results if not r.passed]
    console.print(f"{len(results) - len(failed)}/{len(results)} checks passed" + (f"; FAILED: {', '.join(failed)}" if failed else ""),
                  soft_wrap=True)
    return 1 if failed else 0
