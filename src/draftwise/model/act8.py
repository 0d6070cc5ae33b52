"""int8 activations for weights kept as a GGUF's int8 / int4 groups: the layouts kernels/vnni.c
reads, and the same arithmetic in PyTorch (where the kernels are switched off, and for tests).

A row's activations are quantised per group of 32 inputs, as llama.cpp quantises them for its
Q4_K / Q8_0 products: step xs = max|x| / 127, xq = round(x / xs) in -127..127. Then

    int8 groups (w = d * q):        y = sum_g (d_g * xs_g) * (q_g . xq_g)
    int4 groups (w = d * q + m):    y = sum_g (d_g * xs_g) * (q_g . xq_g) + m_g * sum(x_g)

with byte products summed exactly in int32 (VPDPBUSD). Why: a verification block's 5 rows cost 5
float FMAs per weight through widened weights (compute-bound on 2 cores); byte products are 4x
denser, so a few rows cost about what one row's weight reading costs. The error is the activations'
rounding (half a step of max|x| / 127 per group), below the 4-6-bit weights' own; the held-out
perplexity measures it (benchmarks/qwen_coder_quality.py). The kernels take any number of rows:
for a prefill chunk too, byte products outrun dequantising the weight to float32 for F.linear.

Used where the kernels were built with AVX-512 VNNI (`cpu_kernels.vnni()`) for GGUF blocks kept as
they are (loader.py); DRAFTWISE_ACT8=0 keeps the float-activation products.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_kernels

GROUP = 32


def enabled() -> bool:
    return cpu_kernels.vnni()


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x [.., N] -> float32 [.., N]: each group of 32 as its int8 values times its step (what the
    kernels multiply, rounded the same way: x / step, to nearest even)."""
    shape = x.shape
    g = x.float().reshape(-1, shape[-1] // GROUP, GROUP)
    step = g.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(step > 0, torch.round(g / torch.where(step > 0, step, torch.ones_like(step))), torch.zeros_like(g))
    return (q * step).reshape(shape)


def group_sums(x: torch.Tensor) -> torch.Tensor:
    """x [.., N] -> [.., N/32] float32: each group's sum (the int4 minimum's term)."""
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP).sum(-1)


def _padded(t: torch.Tensor) -> torch.Tensor:
    """t [O, ...] with zero rows up to a multiple of 16 outputs."""
    pad = (-t.shape[0]) % 16
    return t if not pad else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])


def pack_q8(q: torch.Tensor) -> torch.Tensor:
    """int8 q [O, N] -> [ceil(O/16), N/4, 16, 4]: per 4 inputs, 16 outputs' 4 bytes side by side."""
    n = q.shape[1]
    qp = _padded(q)
    return qp.reshape(-1, 16, n // 4, 4).permute(0, 2, 1, 3).contiguous()


def unpack_q8(qv: torch.Tensor, o: int) -> torch.Tensor:
    """pack_q8's inverse: [O, N] int8."""
    return qv.permute(0, 2, 1, 3).reshape(qv.shape[0] * 16, -1)[:o]


def pack_q4(q: torch.Tensor, sm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 (q [O, N/2] uint8, sm [O, G, 2] float16) -> (qv [ceil(O/16), G, 4, 16, 4]: vector j of a
    group holds each output's bytes 4j..4j+3; scales [ceil(O/16), G, 2, 16]: steps, then minima)."""
    g = sm.shape[1]
    qv = _padded(q).reshape(-1, 16, g, 4, 4).permute(0, 2, 3, 1, 4).contiguous()
    sv = _padded(sm).reshape(-1, 16, g, 2).permute(0, 2, 3, 1).contiguous()
    return qv, sv


def unpack_q4(qv: torch.Tensor, sv: torch.Tensor, o: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_q4's inverse: (q [O, N/2], sm [O, G, 2])."""
    g = sv.shape[1]
    q = qv.permute(0, 3, 1, 2, 4).reshape(qv.shape[0] * 16, g * 16)[:o]
    sm = sv.permute(0, 3, 1, 2).reshape(sv.shape[0] * 16, g, 2)[:o]
    return q, sm


def q8_reference(x: torch.Tensor, w: torch.Tensor, bias) -> torch.Tensor:
    """float32 [.., O]: quantised rows times the dequantised int8-group weight w [O, N]."""
    return F.linear(quantized_rows(x), w, bias)


def q4_reference(x: torch.Tensor, q: torch.Tensor, sm: torch.Tensor, bias) -> torch.Tensor:
    """float32 [.., O]: quantised rows times d * q, plus each group's minimum times its float sum."""
    o = q.shape[0]
    b = q.reshape(o, -1, GROUP // 2)
    vals = torch.cat([b & 15, b >> 4], dim=-1).float()  # [O, G, 32]
    smf = sm.float()
    dq = (vals * smf[..., 0:1]).reshape(o, -1)
    return F.linear(quantized_rows(x), dq, bias) + F.linear(group_sums(x), smf[..., 1])


def run(kind: str, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias, out_features: int,
        out_dtype: torch.dtype) -> torch.Tensor:
    """x [.., N] through vnni.c's product of `kind` ("q8g" or "q4") into out_dtype [.., O]."""
    k = cpu_kernels.kernels()
    x = x.contiguous()
    n = x.shape[-1]
    out = torch.empty(*x.shape[:-1], out_features, dtype=out_dtype)
    fn = k.gemm_q8g_a8 if kind == "q8g" else k.linear_q4_a8
    fn(x.data_ptr(), w.data_ptr(), scale.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
       x.numel() // n, out_features, n, torch.get_num_threads(), int(x.dtype == torch.bfloat16),
       int(out_dtype == torch.bfloat16))
    return out
