"""Verification policies: how many tokens each sequence drafts and verifies per step.

One protocol, its typed arguments and a registry by name (base.py), one file (or package) per
policy; the built-ins register themselves when imported here. `cost.py` is the cost model the
goodput policy optimises against; `profile.py` measures it (the hardware profile, `measure.py` the
timing itself); `calibration.py` estimates acceptances online; `dspark.py` is DSpark's prefix scheduler on them.
"""
from .base import (Policy, StatelessPolicy, StepHints, StepPrediction, StepTiming, available_policies,
                   causal_lengths, policy_class, register_policy)
from .cost import CostModel
from . import adaptive, dspark, fixed, goodput  # noqa: F401  (registration)

__all__ = ["Policy", "StatelessPolicy", "StepHints", "StepPrediction", "StepTiming", "CostModel",
           "available_policies", "causal_lengths", "policy_class", "register_policy"]
