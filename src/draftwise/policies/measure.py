"""Measuring a hardware profile: forward times of one model pair on this machine.

`measure_profile` times the target's forward through draftwise's own `ModelRunner` over a grid

    B = 1, 2, 4, ... max_num_seqs  (decoding sequences)
    T = 1 .. k+1                   (tokens fed per sequence: the last committed token + proposals)
    C = a few context lengths      (the position of the first new token)

plus the drafter's single-token step per (B, C), within a time budget: one untimed run per point,
then a few rounds over all points, each point's time the median of its rounds; points whose
estimated cost would overrun the budget are skipped, the most informative kept first (`_points`).
`fit_cost_model` (fit.py) fits `CostModel` (cost.py) to the grid.
"""
from __future__ import annotations

import datetime
import os
import statistics
import time
from typing import Callable

import torch

from ..model.loader import LoadedModel
from ..model.runner import ModelRunner
from .fit import fit_cost_model, fit_errors
from .hardware import DraftPoint, GridPoint, HardwareProfile, dtype_name, machine_info, model_entry

DEFAULT_CONTEXTS = (64, 256)
DEFAULT_BUDGET_SECONDS = 60.0
# untimed runs of a shape before each timed one: WARM_RUNS where a run takes under WARM_BELOW
# seconds (a small target's step, which the caches decide), else none (a larger step streams its
# weights from memory whatever ran before; runs of its own would halve the points the budget allows)
WARM_RUNS = 3
WARM_BELOW = 0.02
TIMING = "warm-short"  # how runs are timed: in the profile cache's key (a profile timed otherwise is measured again)

Progress = Callable[[int, int, str], None]  # (points done, points planned, what runs now)
Point = tuple  # (model: "target" | "draft", B, T, C)


def batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... and max_num_seqs itself."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs]


def _points(bs: list[int], k: int, contexts: list[int], with_draft: bool) -> list[Point]:
    """(model, B, T, C) in measuring order: the most informative first, so that a budget cut
    still leaves every B at the ends of the T range, first at the shortest context."""
    ts = list(range(1, k + 2))
    ends = [1, k + 1]
    pts: list[Point] = []
    for c in contexts:  # every B at both ends of T and the drafter's step, context by context
        for b in bs:  # B by B: a budget cut on a slow target leaves the drafter's small B measured too
            pts += [("target", b, t, c) for t in ends] + ([("draft", b, 1, c)] if with_draft else [])
    for c in contexts:  # the inner T values
        pts += [("target", b, t, c) for b in bs for t in ts if t not in ends]
    return pts


def _time_run(runner: ModelRunner, b: int, t: int, c: int) -> float:
    seq_ids = list(range(b))
    args = (seq_ids, [[1] * t] * b, [c] * b, [t] * b)  # verification needs logits at every fed position
    if runner.state is not None:  # a hybrid model: recurrent states said to be at context c, blocks provisional
        for s in seq_ids:
            runner.state.place(s, c)
    start = time.perf_counter()
    runner.run(*args, provisional=[t > 1] * b)  # logits on the CPU: a GPU forward is finished when it returns
    return time.perf_counter() - start


def _time_draft_step(runner: ModelRunner, b: int, c: int, k: int) -> float:
    """One drafter step of B sequences at context c: for B = 1, a k-step greedy round in one call
    (`ModelRunner.greedy_steps`, what the drafter runs for a lone greedy row) over k; else (or where
    the model cannot) one forward of one token per sequence."""
    if b == 1:
        start = time.perf_counter()
        if runner.greedy_steps(0, [1], c, k) is not None:
            return (time.perf_counter() - start) / k
    return _time_run(runner, b, 1, c)


def _contexts(target: LoadedModel, draft: LoadedModel | None, k: int, contexts) -> list[int]:
    """The contexts to measure (None: DEFAULT_CONTEXTS cut to the models' positions), checked."""
    max_len = target.config.max_position_embeddings
    if draft is not None:
        max_len = min(max_len, draft.config.max_position_embeddings)
    if contexts is None:
        contexts = [min(c, max(max_len - k - 1, 0)) for c in DEFAULT_CONTEXTS]
    contexts = sorted({int(c) for c in contexts})
    if not contexts or contexts[0] < 0 or contexts[-1] + k + 1 > max_len:
        raise ValueError(f"contexts must be in [0, {max_len - k - 1}] (the models' {max_len} positions, "
                         f"minus k+1), got {contexts}")
    return contexts


def _runners(target: LoadedModel, draft: LoadedModel | None, max_num_seqs: int, k: int,
             longest: int) -> dict[str, ModelRunner]:
    """A runner per model whose K/V cache holds every sequence up to the longest context + k + 1
    (zeros: timing does not depend on its values); each sequence's blocks are consecutive, as a
    lone sequence's are in the engine (batch 1 takes the consecutive-slot path)."""
    block_size = 16
    per_seq = -(-(longest + k + 1) // block_size)
    runners = {"target": ModelRunner(target, per_seq * max_num_seqs, block_size)}
    if draft is not None:
        runners["draft"] = ModelRunner(draft, per_seq * max_num_seqs, block_size)
    for r in runners.values():
        for s in range(max_num_seqs):
            r.kv.reserve(s, longest + k + 1)
    return runners


def _plan(runner: ModelRunner, bs: list[int], k: int, contexts: list[int], with_draft: bool, repeats: int,
          deadline: float) -> tuple[list[Point], list[dict]]:
    """The points to measure, in priority order while their estimated runs (one untimed, then
    `repeats` of warm-ups and a timed run) fit before the deadline, and those skipped. The
    estimate: linear in the tokens fed, from the two ends of the grid (each run twice: the first
    call of a shape pays one-time costs)."""
    t_small = min(_time_run(runner, 1, 1, contexts[0]) for _ in range(2))
    n_big = bs[-1] * (k + 1)
    t_big = min(_time_run(runner, bs[-1], k + 1, contexts[-1]) for _ in range(2))

    def estimate(model: str, b: int, t: int) -> float:
        if model == "draft":
            t = 1  # a draft step costs at most a target step of the same shape
        return t_small + (t_big - t_small) * (b * t - 1) / max(n_big - 1, 1)

    points, skipped, planned = [], [], time.perf_counter()
    for model, b, t, c in _points(bs, k, contexts, with_draft):
        run = estimate(model, b, t)
        cost = run * (1 + (1 + _warm_runs(run)) * repeats)  # an untimed run, then repeats x (warm-ups + timed)
        if planned + cost > deadline:
            skipped.append({"model": model, "num_seqs": b, "tokens_per_seq": t, "context": c})
        else:
            points.append((model, b, t, c))
            planned += cost
    return points, skipped


def _warm_runs(seconds: float) -> int:
    """Untimed runs of a shape before a timed one that takes about `seconds`."""
    return WARM_RUNS if seconds < WARM_BELOW else 0


def _sample(runners: dict[str, ModelRunner], points: list[Point], k: int, repeats: int, deadline: float,
            progress: Progress | None) -> dict[Point, list[float]]:
    """One untimed run per point (a shape's first call pays one-time costs), then `repeats` rounds
    over all points: a burst of load from other processes spoils one sample of many points, which
    the median discards, rather than every sample of one point. Each short timed run follows
    untimed ones of the same shape (`_warm_runs`): the engine's decode steps repeat one shape, with the
    weights and the K/V in the caches as the step before left them; a run right after another
    shape's (a batch of 64 rows, say) finds them evicted, and a small target's step measured so
    took twice as long (float32 embedded target on an Intel Xeon: 3.0 ms, against 1.5-1.7 ms
    after three runs of its shape, at one row)."""
    samples: dict[Point, list[float]] = {pt: [] for pt in points}
    first: dict[Point, float] = {}  # the untimed round's seconds: how many warm-up runs a point needs
    total, done = len(points) * (1 + repeats), 0
    for r in range(1 + repeats):
        for pt in points:
            if time.perf_counter() > deadline:
                break
            if progress is not None:
                progress(done, total, f"round {r}/{repeats}: {pt[0]} B={pt[1]} T={pt[2]} C={pt[3]}")
            for _ in range(1 + _warm_runs(first.get(pt, 0.0)) if r else 1):  # the last one timed, warm
                sec = (_time_draft_step(runners["draft"], pt[1], pt[3], k) if pt[0] == "draft"
                       else _time_run(runners[pt[0]], *pt[1:]))
            if r:
                samples[pt].append(sec)
            else:
                first[pt] = sec
            done += 1
    if progress is not None:
        progress(total, total, "fitting")
    return samples


def _grids(samples: dict[Point, list[float]], skipped: list[dict]) -> tuple[list[GridPoint], list[DraftPoint]]:
    """Each measured point's median; points never sampled (the deadline) join `skipped`."""
    grid: list[GridPoint] = []
    draft_grid: list[DraftPoint] = []
    for (model, b, t, c), secs in samples.items():
        if not secs:
            skipped.append({"model": model, "num_seqs": b, "tokens_per_seq": t, "context": c})
        elif model == "target":
            grid.append(GridPoint(b, t, c, statistics.median(secs), len(secs)))
        else:
            draft_grid.append(DraftPoint(b, c, statistics.median(secs), len(secs)))
    grid.sort(key=lambda p: (p.context, p.num_seqs, p.tokens_per_seq))
    draft_grid.sort(key=lambda p: (p.context, p.num_seqs))
    return grid, draft_grid


def measure_profile(
    target: LoadedModel,
    draft: LoadedModel | None,
    *,
    max_num_seqs: int = 64,
    k: int = 4,
    contexts: tuple[int, ...] | None = None,
    budget_seconds: float = DEFAULT_BUDGET_SECONDS,
    repeats: int = 5,
    progress: Progress | None = None,
) -> HardwareProfile:
    """Time the target's forward over the (B, T, C) grid and the drafter's step per (B, C); fit.

    The budget covers everything after the models are loaded: the two ends of the grid are probed
    first, and the points whose estimated runs would overrun it are skipped (`skipped`).
    contexts: None = DEFAULT_CONTEXTS, each cut to the models' positions."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if not 1 <= k <= 63:
        raise ValueError(f"k must be in [1, 63], got {k}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not budget_seconds > 0:
        raise ValueError(f"budget_seconds must be > 0, got {budget_seconds}")
    contexts = _contexts(target, draft, k, contexts)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    t_begin = time.perf_counter()
    deadline = t_begin + budget_seconds
    bs = batch_sizes(max_num_seqs)
    runners = _runners(target, draft, max_num_seqs, k, contexts[-1])
    points, skipped = _plan(runners["target"], bs, k, contexts, draft is not None, repeats, deadline)
    grid, draft_grid = _grids(_sample(runners, points, k, repeats, deadline, progress), skipped)
    if not grid:
        raise ValueError(f"a budget of {budget_seconds:g} s measured no point of the grid; raise it")
    cost = fit_cost_model(grid, draft_grid)
    return HardwareProfile(
        machine={**machine_info(), "load_average": load_before},  # other work competes when high
        torch=torch.__version__, device=str(runners["target"].device), threads=torch.get_num_threads(),
        dtype=dtype_name(runners["target"].dtype),
        draft_dtype=dtype_name(runners["draft"].dtype) if draft is not None else None,
        models={"target": model_entry(target), "draft": model_entry(draft)},
        settings={"max_num_seqs": max_num_seqs, "k": k, "contexts": contexts, "budget_seconds": budget_seconds,
                  "repeats": repeats},
        grid=grid, draft_grid=draft_grid, cost=cost, fit=fit_errors(cost, grid, draft_grid), skipped=skipped,
        measured_seconds=round(time.perf_counter() - t_begin, 3),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
