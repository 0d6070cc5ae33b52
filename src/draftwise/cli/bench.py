"""`draftwise bench`: replay workloads with and without speculation across load levels."""
from __future__ import annotations

import os
import time
from pathlib import Path

from .common import add_progress_arg, add_quantization_arg, draft_load_args, positive_int


def _option(name: str, fn, *args):
    """fn(*args), with a ValueError that does not name an option prefixed by `name`."""
    try:
        return fn(*args)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith("--") else f"{name}: {msg}") from None


def add_parser(sub):
    p = sub.add_parser("bench", help="replay a workload with and without speculation across concurrency levels",
                       description="Replay workloads for every config and load level; write results.json, "
                                   "report.md and plots to --out.")
    p.add_argument("--workload", default=None,
                   help="shipped workload name(s) (code-easy, code-hard, grounded, json, shared-prefix, chat-grounded, "
                        "chat-open, file-edit, json-edit; comma-separated) or a JSONL path "
                        "(default: code-easy,code-hard,grounded; --quick: grounded,code-hard)")
    p.add_argument("--configs", default=None, help="comma-separated: none, draft:k=N, ngram:k=N, suffix:k=N, "
                                                    "dspark:k=N, eagle3:k=N, with an optional "
                                                    ":policy=fixed|adaptive|goodput|dspark (e.g. draft:k=4:policy=goodput), "
                                                    ":forced=N, :tree=N (draft, suffix: a tree of at most k nodes, N children per expanded node), "
                                                    ":rollback=snapshot|replay, :copy=2 (the same config "
                                                    "again in its own engine: an A/A control of the machine's noise) "
                                                    ":draft=DIR (this config's drafter instead of --draft) and "
                                                    ":lookup=ngram|suffix (before the drafter; :lookup_k=N, "
                                                    ":lookup_min=P as --lookup-k, --lookup-min); "
                                                    "none is added when missing, as the reference (default: "
                                                    "none,draft:k=2,draft:k=4,ngram:k=4; --quick: "
                                                    "none,draft:k=4,ngram:k=4; not used with --url)")
    p.add_argument("--profile", default=None, help="hardware profile JSON for goodput and dspark configs (default: the cached "
                                                   "one for the model pair, measured on first use)")
    p.add_argument("--concurrency", default=None,
                   help="closed-loop levels, e.g. 1,4,16 (default: 1,2,4,8,16,32 when neither --request-rate nor "
                        "--find-capacity is given, else none; --quick: 1,4)")
    p.add_argument("--request-rate", default=None, help="open-loop levels in requests/s, e.g. 0.5,1 (default: none)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of open-loop gaps (default 1 = Poisson; below 1 burstier)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per run: the workload's first N (default: the whole workload; --quick: 8)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="cap every request's max_tokens (default: each request's own; --quick: 32)")
    p.add_argument("--output-len", type=int, default=None,
                   help="every request generates exactly this many tokens (e.g. 128-256: long outputs, where "
                        "decoding rather than prefill dominates; prompts keep their tails to fit the context; "
                        "default: each request's own max_tokens, capped by --max-tokens)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="end each reply where the model ends it (max_tokens at most), as a user's request does; "
                        "greedy requests then do the same work under every config (default: EOS ignored, every "
                        "request generates its max_tokens)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of every config per level, the config order rotated each round; each config's "
                        "figures are its median round by output tokens/s, the faster of two (noisy machines; default 1); "
                        "with --find-capacity, runs per probed rate, the median run by the SLO deciding")
    p.add_argument("--time-slice", type=float, default=None, metavar="MS",
                   help="run each round's configs together in one process, switching engines every MS ms, each "
                        "config timed by its own slices only (as if alone): on a machine whose speed drifts, "
                        "configs then meet the same machine and their ratios are far less noisy (e.g. 50; "
                        "default: configs one after another)")
    p.add_argument("--slo", default=None, help="latency limits in ms for goodput, e.g. ttft=1000,tpot=50 "
                                               "(keys: ttft, tpot, itl, e2e; default: none, every completed "
                                               "request counts toward goodput)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="engines do not share cached prompt blocks (each config's engine has its own cache; "
                        "replaying a workload hits it from the second level on)")
    p.add_argument("--find-capacity", action="store_true",
                   help="search, per config, the highest Poisson request rate at which --slo holds at p90 "
                        "(doubling then bisection; reported as requests/s at the latency limit)")
    p.add_argument("--capacity-start-rate", type=float, default=1.0,
                   help="first rate of the capacity search (req/s; default 1)")
    p.add_argument("--dollars-per-hour", type=float, default=None,
                   help="machine price, for cost per million tokens (default: none, no cost column)")
    p.add_argument("--out", default="bench-results", help="output directory (default bench-results)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: workloads grounded,code-hard, 8 requests each, 32 tokens, concurrency 1,4, configs "
                        "none,draft:k=4,ngram:k=4, a distribution test of 2 prompts x 100 samples x 3 tokens (options "
                        "given explicitly win)")
    add_progress_arg(p, "requests done / planned per workload")
    _add_model_args(p)
    return p


def _add_model_args(p) -> None:
    """The models and where they run: in-process, or a server under --url."""
    p.add_argument("--model", help="target model directory (default: the embedded target; not used with --url)")
    p.add_argument("--draft", help="draft model directory, or a DSpark / EAGLE-3 drafter's for dspark / eagle3 configs "
                                   "(default: the embedded draft when --model is not given, models/dspark where the "
                                   "first drafting config is dspark; with --model, draft configs need it)")
    p.add_argument("--url", default=None,
                   help="benchmark an OpenAI-compatible server instead (e.g. http://HOST:8000); the settings record "
                        "what it says about itself (/v1/models; a draftwise server's /health and /metrics), and the "
                        "model options here are not used")
    p.add_argument("--served-model", default=None, help="model name for --url (default: the first of /v1/models)")
    p.add_argument("--reference-url", default=None,
                   help="with --url: a plain server of the same model; both are benchmarked level by level, the "
                        "speedup of --url is against the reference's run at the same level, and its greedy outputs "
                        "are compared token by token with the reference's")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the target's dtype (default float32)")
    p.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16"],
                   help="draft model dtype (default: bfloat16 on a CPU with native bfloat16 products, float32 on other CPUs, else --dtype)")
    add_quantization_arg(p)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op threads (>= 1; default: torch's own, one per core unless OMP_NUM_THREADS "
                        "says otherwise)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds of the sampled requests (request i: seed + i) and of open-loop arrival times "
                        "(default 0)")
    p.add_argument("--markdown", default=None, metavar="PATH", help="also write the report to PATH (e.g. BENCHMARKS.md)")


def _quantization(args) -> str:
    """--quantization, or for a directory stored quantized (import-gguf --keep-quantized) what it runs."""
    if args.quantization not in (None, "none") or args.url or not args.model:
        return args.quantization
    from ..model.loader import stored_quantization

    return stored_quantization(args.model) or args.quantization


def run(args) -> int:
    import torch

    from ..lab.progress import stderr_console
    from ..lab.results import build_results
    from ..lab.runner import run_bench

    if args.threads:
        torch.set_num_threads(args.threads)
    plan, num_requests = _plan(args)
    console = stderr_console(args.progress)
    settings = _settings(args, plan, num_requests)  # before the run: a server's own counters still untouched
    t0 = time.perf_counter()
    results = run_bench(plan, console)
    command = ["draftwise", *args.argv]
    results = build_results(results, settings, command, time.perf_counter() - t0)
    _write(results, args, console)
    _print_failures(results, console)
    return 0


def _plan(args):
    """The bench plan the options ask for (--quick filling what they leave out), checked; and the
    requests per run (None: every request of each workload)."""
    from ..lab.arrivals import parse_levels
    from ..lab.metrics import parse_slo
    from ..lab.runner import QUICK, BenchPlan, parse_configs
    from ..lab.workload import load_workload

    q = QUICK if args.quick else {}
    wl_names = args.workload or ("grounded,code-hard" if args.quick else "code-easy,code-hard,grounded")
    workloads = [load_workload(w.strip()) for w in wl_names.split(",") if w.strip()]
    n = args.num_requests or q.get("num_requests")
    if n is not None and n < 1:
        raise ValueError(f"--num-requests must be >= 1, got {n}")
    workloads = [w.head(n) for w in workloads]
    configs = parse_configs(args.configs or q.get("configs", "none,draft:k=2,draft:k=4,ngram:k=4"), args.profile)
    if args.url:
        configs = []
    conc = args.concurrency
    if conc is None and args.request_rate is None and not args.find_capacity:
        conc = q.get("concurrency", "1,2,4,8,16,32")
    _option("--concurrency", parse_levels, conc, None, args.burstiness)
    _option("--request-rate", parse_levels, None, args.request_rate, args.burstiness)
    levels = parse_levels(conc, args.request_rate, args.burstiness)
    if not levels and not args.find_capacity:
        raise ValueError("give --concurrency and/or --request-rate")
    max_tokens = args.max_tokens or q.get("max_tokens")
    _check_options(args, max_tokens)
    plan = BenchPlan(
        workloads=workloads, configs=configs, levels=levels, model=args.model, draft=args.draft, url=args.url,
        reference_url=args.reference_url, prefix_caching=args.prefix_caching,
        served_model=args.served_model, dtype=args.dtype, draft_dtype=args.draft_dtype, device=args.device,
        quantization=args.quantization, **draft_load_args(args),
        slo=_option("--slo", parse_slo, args.slo), find_capacity=args.find_capacity,
        capacity_start_rate=args.capacity_start_rate, burstiness=args.burstiness,
        dollars_per_hour=args.dollars_per_hour, max_tokens=max_tokens, output_len=args.output_len, seed=args.seed,
        stop_at_eos=args.stop_at_eos,
        repeats=args.repeats, time_slice=args.time_slice / 1000 if args.time_slice else None, progress=args.progress,
        **{k: q[k] for k in ("dist_prompts", "dist_samples", "dist_horizon") if k in q},
    )
    if plan.find_capacity and not plan.slo:
        raise ValueError("--find-capacity needs --slo (e.g. --slo tpot=50 or --slo ttft=1000,tpot=50)")
    return plan, n


def _check_options(args, max_tokens: int | None) -> None:
    """Values out of range, and options that do not go together (a server under --url cannot be
    sliced, repeated in-process or searched for capacity)."""
    from ..paths import resolve_model

    if args.reference_url and not args.url:
        raise ValueError("--reference-url goes with --url (the server to compare against the reference)")
    if args.find_capacity and args.url:
        raise ValueError("--find-capacity runs the in-process engine; it does not combine with --url")
    if not args.capacity_start_rate > 0:
        raise ValueError(f"--capacity-start-rate must be > 0, got {args.capacity_start_rate}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
    if args.output_len is not None and args.output_len < 1:
        raise ValueError(f"--output-len must be >= 1, got {args.output_len}")
    if args.output_len is not None and args.stop_at_eos:
        raise ValueError("--output-len fixes every reply's length; it does not combine with --stop-at-eos")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.repeats > 1 and args.url:
        raise ValueError("--repeats is for in-process runs (with --url, run bench again)")
    if args.time_slice is not None and not args.time_slice > 0:
        raise ValueError(f"--time-slice must be > 0 ms, got {args.time_slice}")
    if args.time_slice is not None and args.url:
        raise ValueError("--time-slice is for in-process runs (a server's requests cannot be sliced)")
    if args.dollars_per_hour is not None and args.dollars_per_hour < 0:
        raise ValueError(f"--dollars-per-hour must be >= 0, got {args.dollars_per_hour}")
    if args.model and not resolve_model(args.model).is_dir():  # a name under models/ counts
        raise ValueError(f"--model: not a directory: {args.model}")
    if args.draft and not resolve_model(args.draft).is_dir():
        raise ValueError(f"--draft: not a directory: {args.draft}")


def _settings(args, plan, num_requests: int | None) -> dict:
    """What results.json records of the run's settings; for --url, the model and speculation as the
    server describes itself (lab/server_info.py), never this command's local defaults."""
    out = {
        "workloads": [w.name for w in plan.workloads], "configs": [c.label for c in plan.configs] or ["server"],
        "levels": [lv.to_dict() for lv in plan.levels], "num_requests": num_requests, "max_tokens": plan.max_tokens,
        "output_len": args.output_len, "stop_at_eos": args.stop_at_eos, "repeats": args.repeats, "time_slice_ms": args.time_slice,
        "prefix_caching": args.prefix_caching,
        "slo_ms": plan.slo, "dollars_per_hour": args.dollars_per_hour, "backend": args.url or "in-process",
        "model": args.model or "embedded", "draft": args.draft or ("embedded" if not args.model else None),
        "dtype": args.dtype, "draft_dtype": args.draft_dtype, "quantization": _quantization(args),
        "device": args.device, "seed": args.seed, "quick": args.quick,
    }
    if args.url:
        from ..lab.server_info import describe_server, server_settings

        reference = describe_server(args.reference_url) if args.reference_url else None
        out.update(server_settings(describe_server(args.url, args.served_model), reference))
    return out


def _write(results: dict, args, console) -> None:
    """results.json, report.md and the plots under --out; the report again at --markdown."""
    from ..lab.report import markdown, write_report

    out = Path(args.out)
    write_report(results, out)
    if args.markdown:
        rel = os.path.relpath(out.resolve(), Path(args.markdown).resolve().parent)
        Path(args.markdown).write_text(markdown(results, title="Benchmarks", image_prefix=f"{rel}/") + "\n")
    console.print(f"wrote {out / 'results.json'}, {out / 'report.md'} and plots")


def _print_failures(results: dict, console) -> None:
    """Failed requests, then greedy outputs that differ from `none`'s."""
    bad = [(w["name"], r["config"], r["level_label"]) for w in results["workloads"] for r in w["runs"]
           if r.get("correctness") and r["correctness"]["mismatching_requests"]]
    for w in results["workloads"]:
        for r in w["runs"]:
            if r["errors"]:
                console.print(f"[red]{w['name']} {r['config']} {r['level_label']}: {r['errors']} requests failed, "
                              f"e.g. {r['error_examples'][0]}[/red]")
    for b in bad:
        console.print(f"[yellow]greedy mismatch vs none: {b}[/yellow]")
