"""The PNG plots of a bench report, one set per workload: capacity at the SLO, throughput and
TPOT against concurrency, latency against throughput, tokens committed per round, conditional
acceptance by position, the drafter's confidence against its acceptance (reliability), and the
tokens drafted and verified per round by load."""
from __future__ import annotations

from pathlib import Path

from .reliability import conditional_acceptance, pooled, reliability


def plot_workload(wl: dict, out: Path) -> list[str]:
    """PNG files (relative names) for one workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    if wl.get("capacity"):
        names.append(_save(_capacity_plot(plt, wl), out, f"{wl['name']}-capacity.png"))
    if not wl["runs"]:
        return names
    configs = list(dict.fromkeys(r["config"] for r in wl["runs"]))
    closed = [r for r in wl["runs"] if r["level"]["kind"] == "concurrency"]
    if closed:
        names.append(_save(_concurrency_plot(plt, wl, configs, closed), out, f"{wl['name']}-concurrency.png"))
    names.append(_save(_latency_throughput_plot(plt, wl, configs), out, f"{wl['name']}-latency-throughput.png"))
    spec = [c for c in configs if c != "none"]
    if spec:
        names.append(_save(_committed_plot(plt, wl, spec), out, f"{wl['name']}-committed-per-round.png"))
        counts = {c: pooled([r.get("speculation") for r in wl["runs"] if r["config"] == c]) for c in spec}
        if any(n["reached"] for n in counts.values()):
            names.append(_save(_position_plot(plt, wl, counts), out, f"{wl['name']}-acceptance-by-position.png"))
        rel = {c: reliability(n["confidence"]["reached"], n["confidence"]["passed"], n["confidence"]["sum"])
               for c, n in counts.items()}
        if any(rel.values()):
            names.append(_save(_reliability_plot(plt, wl, rel), out, f"{wl['name']}-confidence-reliability.png"))
        if closed and any((r.get("speculation") or {}).get("rounds") for r in closed):
            names.append(_save(_lengths_plot(plt, wl, spec, closed), out, f"{wl['name']}-drafted-verified.png"))
    return names


def _capacity_plot(plt, wl: dict):
    cap = wl["capacity"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(list(cap), [c["requests_per_s"] for c in cap.values()])
    ax.set_ylabel("requests/s at the latency limit")
    ax.set_title(f"{wl['name']}: capacity at the SLO")
    ax.grid(alpha=0.3, axis="y")
    return fig


def _concurrency_plot(plt, wl: dict, configs: list[str], closed: list[dict]):
    """Output tokens/s and p50 TPOT against the closed-loop concurrency, one line per config."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for c in configs:
        rs = sorted((r for r in closed if r["config"] == c), key=lambda r: r["level"]["value"])
        x = [r["level"]["value"] for r in rs]
        axes[0].plot(x, [r["output_tokens_per_s"] for r in rs], marker="o", label=c)
        axes[1].plot(x, [r["tpot_ms"]["p50"] for r in rs], marker="o", label=c)
    for ax, yl in zip(axes, ("output tokens/s", "p50 TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{wl['name']}: throughput and TPOT vs concurrency")
    return fig


def _latency_throughput_plot(plt, wl: dict, configs: list[str]):
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in configs:
        rs = sorted((r for r in wl["runs"] if r["config"] == c), key=lambda r: r["output_tokens_per_s"])
        ax.plot([r["output_tokens_per_s"] for r in rs], [r["e2e_ms"]["p50"] for r in rs], marker="o", label=c)
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("p50 end-to-end latency (ms)")
    ax.set_title(f"{wl['name']}: latency vs throughput")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def _committed_plot(plt, wl: dict, spec: list[str]):
    """The share of rounds that committed each number of tokens, per speculative config, all levels pooled."""
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(spec)
    for i, c in enumerate(spec):
        hist: dict[int, int] = {}
        for r in wl["runs"]:
            if r["config"] == c and r.get("speculation"):
                for k, v in r["speculation"]["committed_per_round"].items():
                    hist[int(k)] = hist.get(int(k), 0) + v
        tot = sum(hist.values()) or 1
        xs = sorted(hist)
        ax.bar([x + i * width for x in xs], [hist[x] / tot for x in xs], width=width, label=c)
    ax.set_xlabel("tokens committed per round")
    ax.set_ylabel("fraction of rounds")
    ax.set_title(f"{wl['name']}: committed per round (all levels)")
    ax.legend()
    return fig


def _position_plot(plt, wl: dict, counts: dict):
    """P(proposal j accepted | every one before it accepted), chain rounds of all levels pooled."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for c, n in counts.items():
        cond = conditional_acceptance(n["reached"], n["passed"])
        xs = [j + 1 for j, v in enumerate(cond) if v is not None]
        if xs:
            ax.plot(xs, [v for v in cond if v is not None], marker="o", label=c)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft position j")
    ax.set_ylabel("P(accepted | 1..j-1 accepted)")
    ax.set_title(f"{wl['name']}: conditional acceptance by position")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def _reliability_plot(plt, wl: dict, rel: dict):
    """Mean confidence against the accepted share per confidence bin; the diagonal is calibrated."""
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--")
    for c, r in rel.items():
        if r:
            ax.plot([b[0] for b in r["bins"]], [b[1] for b in r["bins"]], marker="o",
                    label=f"{c} (ECE {r['ece']:.3f}, {r['positions']} positions)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("drafter's confidence (bin mean)")
    ax.set_ylabel("accepted share")
    ax.set_title(f"{wl['name']}: confidence reliability")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _lengths_plot(plt, wl: dict, spec: list[str], closed: list[dict]):
    """Tokens drafted and verified per round against the concurrency: what a policy admits by load."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, c in enumerate(spec):
        rs = sorted((r for r in closed if r["config"] == c and (r.get("speculation") or {}).get("rounds")),
                    key=lambda r: r["level"]["value"])
        if not rs:
            continue
        x = [r["level"]["value"] for r in rs]
        sps = [r["speculation"] for r in rs]
        line, = ax.plot(x, [s["proposed_tokens"] / s["rounds"] for s in sps], marker="o", ls="--",
                        label=f"{c} drafted")
        ax.plot(x, [s["verified_tokens"] / s["rounds"] for s in sps], marker="s", color=line.get_color(),
                label=f"{c} verified")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("tokens per round")
    ax.set_title(f"{wl['name']}: drafted and verified per round")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _save(fig, out: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out / name, dpi=100)
    plt.close(fig)
    return name
