"""`goodput`: per request, per step, the verification lengths that maximise the step's expected
committed tokens per second, under a measured check of what the steps actually gave.

- plan.py: the core: `choose_lengths` (the optimiser), the probes, causal admission.
- arms.py: the measured arms at one batch size ("spec", "full", "plain"): ratings, bursts, coasting.
- check.py: the measured check across batch sizes: the batch a step belongs to, the exploration
  budget, what each step records.
- config.py: `GoodputConfig`, every tuned constant.
- policy.py: `GoodputPolicy`, the `Policy` the engine calls.
"""
from .arms import ARMS, Arms, batch_bucket
from .config import GoodputConfig
from .plan import admitted_lengths, choose_lengths
from .policy import GoodputPolicy

__all__ = ["ARMS", "Arms", "GoodputConfig", "GoodputPolicy", "admitted_lengths", "batch_bucket", "choose_lengths"]
