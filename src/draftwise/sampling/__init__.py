"""Sampling: per-request parameters, logit processing, and the rejection sampler.

p is the target's distribution and q the draft's, everywhere.
"""
from .params import SamplingParams
from .processors import probs_from_logits, process_logits
from .rejection import (
    accept_probability,
    categorical_from_uniform,
    greedy_accept,
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
    "greedy_accept",
    "rejection_sample_from_uniforms",
    "accept_probability",
    "residual_mass",
    "residual_distribution",
    "categorical_from_uniform",
]
