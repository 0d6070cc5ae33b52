"""`draftwise profile`: measure the hardware profile of a model pair (policies/profile.py).

Times the target's forward over (B sequences) x (T tokens each) at a few context lengths and the
drafter's step per B, fits the cost model, prints the table and the fit, and writes the JSON
(default: the cache file the engine reads for these models and settings) and optionally a plot.
"""
from __future__ import annotations

import os
from pathlib import Path

from .common import METHOD_HELP_PROFILE, add_model_args, add_progress_arg, spec_from_args


def add_parser(sub):
    p = sub.add_parser("profile", help="measure step times of a model pair (the cost model of the goodput policy)",
                       description="Time the target's forward over B sequences x T tokens each (B = 1, 2, 4, ... "
                                   "--max-num-seqs; T = 1 .. k+1) at a few context lengths, and the drafter's "
                                   "step per B; fit the cost model; write the versioned JSON. With --method ngram or none "
                                   "(or --model without --draft) no draft model is timed: draft cost 0.")
    add_model_args(p, engine=False, method_help=METHOD_HELP_PROFILE)
    p.add_argument("--max-num-seqs", type=int, default=64, help="largest batch measured (default 64)")
    p.add_argument("--contexts", default="64,256", help="context lengths, comma-separated (default 64,256)")
    p.add_argument("--budget", type=float, default=60.0, help="seconds of measurement at most (default 60)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed runs per point, the median kept; a run under 20 ms follows three untimed runs of "
                        "its shape (the caches as the engine's repeated steps leave them) (default 5)")
    p.add_argument("--out", default=None,
                   help="JSON file to write (default: the cache file the engine reads for these models, dtypes, "
                        "device and threads, under $DRAFTWISE_CACHE/profiles, by default ~/.cache/draftwise/profiles)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also plot step time against tokens per sequence (default: no plot)")
    add_progress_arg(p, "grid points measured / planned")
    return p


def _check_writable(option: str, path: str) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"{option}: {path} is a directory, expected a file name")
    parent = p.parent
    if not parent.is_dir():
        raise ValueError(f"{option}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{option}: directory {parent} is not writable")
    return p


def _parse_args(args) -> list[int]:
    for name, low in (("max_num_seqs", 1), ("repeats", 1), ("threads", 1)):
        v = getattr(args, name)
        if v is not None and v < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {v}")
    if not 1 <= args.k <= 16:
        raise ValueError(f"--k must be in [1, 16], got {args.k}")
    if not args.budget > 0:
        raise ValueError(f"--budget must be > 0 seconds, got {args.budget:g}")
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--contexts: expected comma-separated integers, got {args.contexts!r}") from None
    if not contexts or min(contexts) < 0:
        raise ValueError(f"--contexts: expected integers >= 0, got {args.contexts!r}")
    return contexts


def run(args) -> int:
    contexts = _parse_args(args)
    out = _check_writable("--out", args.out) if args.out else None
    plot = _check_writable("--plot", args.plot) if args.plot else None

    import torch

    from ..lab.progress import make_progress, stderr_console

    from ..model.pair import LoadedDSpark, LoadedEagle3, load_pair
    from ..policies.profile import measure_profile, profile_cache_path
    from ..proposers import proposer_class

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = spec_from_args(args)
    needs_draft = spec.method is not None and proposer_class(spec.method).needs_draft_model
    target, draft = load_pair(args.model, args.draft, needs_draft=needs_draft, dtype=args.dtype,
                              draft_dtype=args.draft_dtype, device=args.device, method=spec.method or "draft")
    if isinstance(draft, (LoadedDSpark, LoadedEagle3)):  # a drafter on the target's features: the target's profile
        draft = None
    console = stderr_console(args.progress)
    console.print(f"draftwise profile: target {target.path}" + (f", draft {draft.path}" if draft else ", no draft")
                  + f", threads {torch.get_num_threads()}, budget {args.budget:g} s")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > (os.cpu_count() or 1) - 0.5:
        console.print(f"[yellow]warning: load average {load:.1f} on {os.cpu_count()} CPUs: other processes compete, "
                      "the times will be noisy[/yellow]")
    with make_progress(console, args.progress, transient=True) as bar:
        task = bar.add_task("measuring", total=1)
        prof = measure_profile(target, draft, max_num_seqs=args.max_num_seqs, k=args.k, contexts=contexts,
                               budget_seconds=args.budget, repeats=args.repeats,
                               progress=lambda done, total, what: bar.update(task, completed=done, total=total,
                                                                             description=what))
    if out is None:
        out = profile_cache_path(target.path, draft.path if draft else None, prof.dtype, prof.draft_dtype,
                                 prof.device, prof.threads)
    try:
        prof.save(out)
    except OSError as e:
        raise ValueError(f"--out: cannot write {out} ({e.strerror or e})") from None

    _print_profile(prof, out)
    if plot is not None:
        from ..lab.profile_plot import plot_profile

        plot_profile(prof, plot)
        print(f"wrote {plot}")
    return 0


def _print_profile(prof, out) -> None:
    """The measured grid, the fitted cost model and its error, on stdout."""
    from rich.console import Console
    from rich.table import Table

    stdout = Console()
    c0 = min(p.context for p in prof.grid)
    ts = sorted({p.tokens_per_seq for p in prof.grid})
    table = Table(title=f"target forward, ms (context {c0}; median of {prof.settings['repeats']})")
    table.add_column("B", justify="right")
    for t in ts:
        table.add_column(f"T={t}", justify="right")
    if prof.draft_grid:
        table.add_column("draft step", justify="right")
    cell = {(p.num_seqs, p.tokens_per_seq): p.seconds for p in prof.grid if p.context == c0}
    dcell = {p.num_seqs: p.seconds for p in prof.draft_grid if p.context == c0}
    for b in sorted({p.num_seqs for p in prof.grid}):
        row = [str(b)] + [f"{cell[b, t] * 1e3:.2f}" if (b, t) in cell else "-" for t in ts]
        if prof.draft_grid:
            row.append(f"{dcell[b] * 1e3:.2f}" if b in dcell else "-")
        table.add_row(*row)
    stdout.print(table)
    t0, t_seq, t_tok, t_ctx = prof.cost.target
    d0, d_seq, d_ctx = prof.cost.draft
    stdout.print(f"cost model (ms): target = {t0 * 1e3:.3f} + {t_seq * 1e3:.4f}*B + {t_tok * 1e3:.4f}*tokens"
                 f" + {t_ctx * 1e3:.3g}*B*context")
    stdout.print(f"                 draft step = {d0 * 1e3:.3f} + {d_seq * 1e3:.4f}*B + {d_ctx * 1e3:.3g}*B*context")
    fit = prof.fit
    line = (f"fit: median relative error {fit['median_rel_error']:.1%} (max {fit['max_rel_error']:.1%}) "
            f"over {fit['points']} points")
    if "draft_median_rel_error" in fit:
        line += f"; draft {fit['draft_median_rel_error']:.1%}"
    stdout.print(line)
    stdout.print(f"measured in {prof.measured_seconds:.1f} s"
                 + (f"; {len(prof.skipped)} points skipped to stay within the budget" if prof.skipped else "")
                 + f"; wrote {out}")
