"""Fitting the cost model (cost.py) to a measured hardware profile's grid (profile.py).

Least squares on relative error with coefficients >= 0; the grid points are any objects with
`num_seqs`, `tokens_per_seq` (target points), `context` and `seconds`.
"""
from __future__ import annotations

import numpy as np

from .cost import CostModel


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on relative error (rows weighted by 1/y: a 3 ms step counts as much as a
    300 ms one), with coefficients >= 0: the most negative coefficient is fixed at 0 and the
    rest refitted, until none is negative."""
    w = 1.0 / np.maximum(y, 1e-12)
    xw, yw = x * w[:, None], y * w
    free = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while free:
        sol = np.linalg.lstsq(xw[:, free], yw, rcond=None)[0]
        if (sol >= 0).all():
            coef[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return coef


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, ...]:
    """`_nonneg_lstsq` over the columns the points can tell apart: each column, in order (the
    fixed cost first), kept only where it raises the rank (one context measured says nothing of a
    per-context cost, one batch size nothing of a per-row one: such a coefficient is 0, not a
    share of the others' time)."""
    keep: list[int] = []
    for j in range(x.shape[1]):
        if np.linalg.matrix_rank(x[:, keep + [j]]) > len(keep):
            keep.append(j)
    coef = np.zeros(x.shape[1])
    coef[keep] = _nonneg_lstsq(x[:, keep], y)
    return tuple(float(v) for v in coef)


def fit_cost_model(grid: list, draft_grid: list) -> CostModel:
    """Fit `CostModel` to measured points: the target's (t0, t_seq, t_tok, t_ctx) on
    [1, B, B*T, B*C] and the drafter's (d0, d_seq, d_ctx) on [1, B, B*C]; no draft points ->
    draft coefficients 0 (no drafter, or one too cheap to have been measured)."""
    if not grid:
        raise ValueError("cannot fit a cost model to an empty grid")
    x = np.array([[1.0, p.num_seqs, p.num_seqs * p.tokens_per_seq, p.num_seqs * p.context] for p in grid])
    y = np.array([p.seconds for p in grid])
    target = _fit(x, y)
    draft = (0.0, 0.0, 0.0)
    if draft_grid:
        xd = np.array([[1.0, p.num_seqs, p.num_seqs * p.context] for p in draft_grid])
        yd = np.array([p.seconds for p in draft_grid])
        draft = _fit(xd, yd)
    return CostModel(target, draft)


def predict_target(cost: CostModel, p) -> float:
    return cost.target_seconds(p.num_seqs, p.num_seqs * p.tokens_per_seq, p.context)


def fit_errors(cost: CostModel, grid: list, draft_grid: list) -> dict:
    """|predicted - measured| / measured over the grid: median and max, target and drafter."""
    rel = [abs(predict_target(cost, p) - p.seconds) / p.seconds for p in grid]
    out = {"points": len(grid), "median_rel_error": float(np.median(rel)), "max_rel_error": float(max(rel))}
    if draft_grid:
        rd = [abs(cost.draft_seconds(p.num_seqs, p.context) - p.seconds) / p.seconds for p in draft_grid]
        out.update(draft_points=len(draft_grid), draft_median_rel_error=float(np.median(rd)),
                   draft_max_rel_error=float(max(rd)))
    return out
