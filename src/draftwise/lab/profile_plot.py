"""Plot a hardware profile: the target's step time against tokens per sequence, one line per B.

Left, per context length: milliseconds per forward (log scale), measured (solid, markers) and as
the fitted cost model predicts (dashed). Right: the same times relative to feeding one token per
sequence, which shows where verifying more proposals stops being nearly free (a flat line: the
extra tokens ride on a memory-bound step; a line rising towards T: the step is compute-bound and
each proposal costs its share).
"""
from __future__ import annotations

from pathlib import Path

from ..policies.profile import HardwareProfile, predict_target


def plot_profile(profile: HardwareProfile | str | Path, out: str | Path) -> Path:
    """Write the PNG (any format matplotlib infers from the suffix) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    prof = profile if isinstance(profile, HardwareProfile) else HardwareProfile.load(profile)
    contexts = sorted({p.context for p in prof.grid})
    bs = sorted({p.num_seqs for p in prof.grid})
    cmap = plt.get_cmap("viridis")
    colors = {b: cmap(i / max(len(bs) - 1, 1) * 0.9) for i, b in enumerate(bs)}
    fig, axes = plt.subplots(1, len(contexts) + 1, figsize=(4.6 * (len(contexts) + 1), 4.2), squeeze=False)
    axes = axes[0]
    for ax, c in zip(axes, contexts):
        for b in bs:
            pts = sorted((p for p in prof.grid if p.context == c and p.num_seqs == b), key=lambda p: p.tokens_per_seq)
            if not pts:
                continue
            ts = [p.tokens_per_seq for p in pts]
            ax.plot(ts, [p.seconds * 1e3 for p in pts], marker="o", color=colors[b], label=f"B={b}")
            ax.plot(ts, [predict_target(prof.cost, p) * 1e3 for p in pts], ls="--", lw=1, color=colors[b])
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"context {c}: measured (solid), fitted (dashed)", fontsize=10)
        ax.set_xlabel("tokens per sequence (1 + verified proposals)")
        ax.set_ylabel("target forward (ms)")
        ax.grid(alpha=0.3, which="both")
    ax = axes[-1]
    c0 = contexts[0]
    for b in bs:
        pts = {p.tokens_per_seq: p.seconds for p in prof.grid if p.context == c0 and p.num_seqs == b}
        if 1 not in pts or len(pts) < 2:
            continue
        ts = sorted(pts)
        ax.plot(ts, [pts[t] / pts[1] for t in ts], marker="o", color=colors[b], label=f"B={b}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_title(f"context {c0}: relative to 1 token per sequence", fontsize=10)
    ax.set_xlabel("tokens per sequence (1 + verified proposals)")
    ax.set_ylabel("step time / step time at 1 token")
    ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, ncol=2)
    ks = list(range(1, prof.settings.get("k", max(p.tokens_per_seq for p in prof.grid) - 1) + 2))
    for ax in axes:
        ax.set_xticks(ks)
    target = Path(prof.models["target"]["path"]).name
    fig.suptitle(f"hardware profile: {target}, {prof.dtype}, {prof.device}, {prof.threads} thread{'s' if prof.threads != 1 else ''} "
                 f"({prof.machine.get('cpu', '?')})", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
