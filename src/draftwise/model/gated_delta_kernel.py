"""`recurrent_rule` through the C loop of gated_delta.c (float32, CPU), loaded with ctypes.

Built once per machine like the kernels of `kernels/` (`cpu_kernels._build`: `cc -O3 -march=native`, cached);
off with `DRAFTWISE_KERNELS=0` or without a compiler (then `fused_recurrent_rule` returns None
and the caller runs the PyTorch rule; tests compare the two). Per token and value head the C loop
reads the d_k x d_v state twice; PyTorch launched ~10 ops for the same work, which dominated the
hybrid model's decode and verification steps.
"""
from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from . import cpu_kernels

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("gated_delta.c")
MAX_DV = 1024  # the C loop's row buffers
_FN: "object | None | bool" = False  # False: not tried yet


def _library():
    global _FN
    if os.environ.get("DRAFTWISE_KERNELS", "1") == "0":
        return None
    if _FN is False:
        _FN = None
        try:
            fn = ctypes.CDLL(str(cpu_kernels._build(SOURCE))).gd_recurrent
            fn.argtypes, fn.restype = [ctypes.c_void_p] * 8 + [ctypes.c_long] * 5, None
            _FN = fn
        except Exception as e:  # no compiler, a failed build: the PyTorch rule still works
            log.warning("draftwise: gated delta kernel unavailable (%s); using the PyTorch rule", e)
    return _FN


def fused_recurrent_rule(q, k, v, g, beta, S, states_out: torch.Tensor | None = None):
    """Same arguments and result as `gated_delta.recurrent_rule` ((o, final S)), or None where the C
    loop cannot run (kernels off, not on the CPU, d_v too large, a non-contiguous `states_out`)."""
    fn = _library()
    if fn is None or q.device.type != "cpu" or v.shape[-1] > MAX_DV:
        return None
    if states_out is not None and not (states_out.is_contiguous() and states_out.dtype == torch.float32):
        return None
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.to(torch.float32).contiguous() for x in (q, k, v, g, beta))
    S = S.to(torch.float32).clone(memory_format=torch.contiguous_format)  # updated in place: our own copy
    out = torch.empty(B, T, H, dv, dtype=torch.float32)
    fn(S.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), out.data_ptr(),
       None if states_out is None else states_out.data_ptr(), B, T, H, dk, dv)
    return out, S
