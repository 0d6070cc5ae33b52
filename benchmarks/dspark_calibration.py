"""Sequential Temperature Scaling of a DSpark drafter: fit one temperature per block position on
held-out windows, write them into the drafter's config.json, report the ECE of the cumulative
survival before and after on other held-out windows, and draw the reliability plot.

    .venv/bin/python benchmarks/dspark_calibration.py DRAFTER_DIR [--out DIR] [--windows N] [--dry-run]

Fit: held-out windows 0..N-1; test: windows N..2N-1 (default N = 32 windows of 256 tokens, 48
anchors each). --dry-run reports without writing config.json. --out DIR: calibration.json and
reliability.png there.
"""
import argparse
import json
import time
from pathlib import Path

import torch

from draftwise import corpus
from draftwise.model.dspark import load_dspark
from draftwise.model.loader import load_model
from draftwise.train.data import eval_windows, load_streams
from draftwise.train.dspark_calibration import ECE_BINS, calibrate, held_out_blocks, survival

ANCHORS = 48


def reliability_plot(logits, c_star, temperatures, out: Path) -> None:
    """Mean empirical cumulative acceptance against the mean survival per bin, each position, before
    (T = 1) and after STS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    actual = c_star.double().cumprod(-1)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5), sharey=True)
    for ax, temps, title in ((axes[0], None, "before (T = 1)"), (axes[1], temperatures, "after STS")):
        s = survival(logits, temps)
        for k in range(s.shape[-1]):
            idx = (s[:, k] * ECE_BINS).long().clamp(0, ECE_BINS - 1)
            xs, ys = [], []
            for b in range(ECE_BINS):
                sel = idx == b
                if int(sel.sum()) >= 5:
                    xs.append(float(s[sel, k].mean()))
                    ys.append(float(actual[sel, k].mean()))
            ax.plot(xs, ys, marker="o", ms=3, label=f"k = {k + 1}")
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        ax.set_title(title)
        ax.set_xlabel("predicted survival prod c_i")
    axes[0].set_ylabel("cumulative acceptance prod c*_i")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "reliability.png", dpi=100)
    plt.close(fig)


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("drafter")
    ap.add_argument("--out", default=None)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    tl = load_model("models/target", dtype="float32", fuse=False)
    target = tl.model.eval()
    drafter = load_dspark(args.drafter, target)
    streams = load_streams(tl.tokenizer, corpus.split(), "checkpoints/dspark_eval")
    w = eval_windows(streams["val"], 256, 2 * args.windows)
    result = calibrate(drafter, target, w[: args.windows], w[args.windows:], ANCHORS)
    if not args.dry_run:
        f = Path(args.drafter) / "config.json"
        cfg = json.loads(f.read_text())
        cfg["confidence_temperatures"] = result["temperatures"]
        f.write_text(json.dumps(cfg, indent=2) + "\n")
    result["seconds"] = round(time.time() - t0, 1)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "calibration.json").write_text(json.dumps(result, indent=1) + "\n")
        reliability_plot(*held_out_blocks(drafter, target, w[args.windows:], ANCHORS, seed=1),
                         result["temperatures"], out)
    return result


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    print(json.dumps(main(), indent=1))
