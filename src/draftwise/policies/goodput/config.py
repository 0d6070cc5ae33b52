"""`GoodputConfig`: every tuned constant of the goodput policy, in one frozen dataclass.

A field's comment says why the constant exists; docs/ARCHITECTURE.md gives the reason of each
(a constant stays only where a paired A/B shows it helps). `GoodputPolicy(config=...)`
takes another one, for an A/B or a test.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GoodputConfig:
    # ---- probes (plan.py): rows the plan leaves out verify one proposal now and then
    probe_every: int = 32  # steps without verifying before a row probes: its estimate can recover
    max_probe_every: int = 512  # the longest wait a probe that accepts nothing doubles to: a useless drafter costs ever fewer
    probe_backoff: int = 2  # factor of that wait after a probe that accepted nothing

    # ---- the drafter's catch-up (plan.py)
    catch_up_horizon: int = 64  # at most this many steps share a row's catch-up when the plan weighs starting to draft
    catch_up_learning: float = 0.2  # how fast the learned seconds per caught-up token follow the timings (log space)
    catch_up_log: bool = True  # that step in log space (False: a step in seconds, for an A/B)
    catch_up_per_token: float = 2e-5  # seconds per caught-up token before any is timed, where the profile has no per-row drafter cost

    # ---- the cost model
    learn_step_cost: bool = True  # learn online what the profile misses of a whole step (False: the profile alone, for an A/B)
    cost_fade_by_steps: bool = True  # the cost fit's old steps also fade by multi-step calls' steps (False: by observations, for an A/B)

    # ---- the measured check across batch sizes (check.py)
    coast_observe_every: int = 4  # of coasting steps, one in this many feeds the cost model, the leader's figures, the calibration
    explore_budget: float = 0.02  # share of the run's step time that looks away from the leading arm may cost
    credit_cap: float = 0.25  # seconds: the budget banks no more (no cluster of looks after a long run)

    # ---- the measured check at one batch size (arms.py)
    burst: int = 3  # steps a look at another arm lasts: one step is too noisy, and the first may pay a catch-up
    decay: float = 0.9  # per step of an arm: its seconds follow its last ~10 steps (the machine drifts)
    token_decay: float = 0.98  # its committed / expected tokens follow its last ~50 (tokens vary far more, do not drift)
    token_prior: float = 0.25  # weight of a neighbouring batch size's committed / expected tokens at a new one
    explore_every: int = 32  # steps between looks at an arm at first, and after a look that put it clearly ahead
    max_explore_every: int = 1024  # the longest wait between looks at an arm that stays behind
    first_look: int = 16  # steps before the first look at an arm at a new batch size (its neighbour's figures until then)
    look_later: int = 2  # factor of the wait after a look that left the arm behind or tied
    look_much_later: int = 4  # ... after one that left it far behind, and before the first look at an arm the model puts far behind
    margin: float = 0.95  # a look puts an arm clearly ahead only past 1 / margin of the others
    far: float = 0.8  # an arm rated below far x the best is far behind
    plan_edge: float = 1.03  # "spec" runs instead of "full" only when rated this much ahead: two noisy estimates
    switch: float = 1.05  # drafting <-> plain steps only when the other side is rated this much ahead: each switch pays
    coast: float = 1.1  # a leader this much ahead of every rival runs without the plan (coasts)
    coast_steps: int = 16  # steps a coast lasts before the check decides again
    far_coast_steps: int = 64  # ... while the leader leads by more than 1 / far
