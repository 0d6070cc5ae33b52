"""Sampling: per-request parameters, logit processing, the rejection sampler and `verify`
(the selection rule over a ragged batch).

p is the target's distribution and q the draft's, everywhere.
"""
from .params import SamplingParams
from .processors import probs_from_logits, process_logits
from .verify import VerifyMetadata, VerifyResult, flat_draft_probs, verify
from .rejection import (
    accept_probability,
    categorical_from_uniform,
    rejection_sample,
    rejection_sample_from_uniforms,
    residual_distribution,
    residual_mass,
)

__all__ = [
    "SamplingParams",
    "process_logits",
    "probs_from_logits",
    "rejection_sample",
    "verify",
    "VerifyMetadata",
    "VerifyResult",
    "flat_draft_probs",
    "rejection_sample_from_uniforms",
    "accept_probability",
    "residual_mass",
    "residual_distribution",
    "categorical_from_uniform",
]
