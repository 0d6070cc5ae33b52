"""The PNG plots of a bench report, one set per workload: capacity at the SLO, throughput and
TPOT against concurrency, latency against throughput, and tokens committed per round."""
from __future__ import annotations

from pathlib import Path


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


def _save(fig, out: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out / name, dpi=100)
    plt.close(fig)
    return name
