"""Sequential Temperature Scaling (DSpark, "Calibration") of a DSpark drafter's confidences.

The scheduler admits block position k by its survival s_k = prod_{i<=k} c_i, so what must be
calibrated is that product, not each c_k alone. One temperature per position, fitted left to right
on held-out blocks: c_k = sigmoid(logit_k / T_k), T_k chosen (T_1..T_{k-1} fixed) to minimise the
expected calibration error of s_k against the empirical cumulative acceptance of position k.

The empirical acceptance of a held-out block is the rejection sampler's, teacher-forced: position
k is accepted with probability c*_k = 1 - TV(q_k, p_k) (train/dspark_eval.py), so the block's
first k positions all are with probability a_k = prod_{i<=k} c*_i. ECE reads a_k in place of 0/1
outcomes (same expectation, less noise): the mean over bins of equal width on s, weighted by the
bin's share of blocks, of |mean s - mean a|.
"""
from __future__ import annotations

import torch

from .dspark_blocks import block_forward, sample_anchors

ECE_BINS = 15
# candidate temperatures: log-spaced, 1 included (a T that does not help leaves c_k unchanged)
TEMPERATURE_GRID = torch.logspace(-1.0, 1.0, 161)


def ece(pred: torch.Tensor, actual: torch.Tensor, bins: int = ECE_BINS) -> float:
    """Expected calibration error of predictions `pred` [M] in [0, 1] against `actual` [M]."""
    pred, actual = pred.flatten().double(), actual.flatten().double()
    if pred.numel() == 0:
        return 0.0
    idx = (pred * bins).long().clamp(0, bins - 1)
    n = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, torch.ones_like(pred))
    gap = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, pred - actual)
    return float(gap.abs().sum() / pred.numel())


def survival(logits: torch.Tensor, temperatures: list[float] | None = None) -> torch.Tensor:
    """Confidence logits [M, gamma] -> s_k = prod_{i<=k} sigmoid(logit_i / T_i) [M, gamma]."""
    t = torch.tensor(temperatures or [1.0] * logits.shape[-1], dtype=torch.float64)
    return torch.sigmoid(logits.double() / t).cumprod(-1)


def fit_temperatures(logits: torch.Tensor, c_star: torch.Tensor,
                     grid: torch.Tensor = TEMPERATURE_GRID) -> list[float]:
    """Left to right: T_k from `grid` minimising ECE(s_k, a_k), the earlier T_i fixed.
    logits, c_star [M, gamma] (whole blocks) -> [T_1..T_gamma]."""
    actual = c_star.double().cumprod(-1)
    before = torch.ones(logits.shape[0], dtype=torch.float64)  # s_{k-1} at the chosen T_1..T_{k-1}
    temps = []
    for k in range(logits.shape[-1]):
        errs = [ece(before * torch.sigmoid(logits[:, k].double() / t), actual[:, k]) for t in grid.tolist()]
        best = min(range(len(errs)), key=errs.__getitem__)
        temps.append(round(float(grid[best]), 4))
        before = before * torch.sigmoid(logits[:, k].double() / temps[-1])
    return temps


def report(logits: torch.Tensor, c_star: torch.Tensor, temperatures: list[float] | None) -> dict:
    """ECE of the survival at each position and over all (block, position) pairs, and the means."""
    s, a = survival(logits, temperatures), c_star.double().cumprod(-1)
    return {"ece_per_position": [round(ece(s[:, k], a[:, k]), 4) for k in range(s.shape[-1])],
            "ece": round(ece(s, a), 4),
            "mean_survival": [round(float(x), 4) for x in s.mean(0)],
            "mean_acceptance": [round(float(x), 4) for x in a.mean(0)]}


@torch.no_grad()
def held_out_blocks(drafter, target, windows: torch.Tensor, anchors: int, seed: int = 0):
    """The confidence logits and c* [M, gamma] of the whole blocks (inside their window) at seeded
    anchors of windows [N, T]."""
    g = torch.Generator().manual_seed(seed)
    logits, c_star = [], []
    for w in windows.split(2):
        a = sample_anchors(w.shape[0], w.shape[1], anchors, g)
        q_logits, p, conf, _, valid = block_forward(drafter, target, w, a)
        q = torch.softmax(q_logits.float(), -1)
        whole = valid.all(-1)
        logits.append(conf[whole].float())
        c_star.append((1 - 0.5 * (q - p).abs().sum(-1))[whole].clamp(0.0, 1.0))
    return torch.cat(logits), torch.cat(c_star)


def calibrate(drafter, target, fit_windows: torch.Tensor, test_windows: torch.Tensor, anchors: int) -> dict:
    """Fit T_k on `fit_windows`, set them in the drafter's config (save_dspark writes them), and
    report the ECE before (T = 1) and after on `test_windows` (other held-out text)."""
    temps = fit_temperatures(*held_out_blocks(drafter, target, fit_windows, anchors))
    drafter.cfg.confidence_temperatures = temps
    logits, c_star = held_out_blocks(drafter, target, test_windows, anchors, seed=1)
    return {"temperatures": temps, "fit_blocks_windows": int(fit_windows.shape[0]),
            "test_blocks": int(logits.shape[0]), "before": report(logits, c_star, None),
            "after": report(logits, c_star, temps)}
