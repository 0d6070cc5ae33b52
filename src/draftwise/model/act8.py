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

Q4_K super-blocks (w = d * sc_j * q - dmin * mn_j, sc_j and mn_j 6-bit integers per 32 inputs, d
and dmin float16 per 256) run with their integer sub-scales where the import kept them (`.qsub`,
`.qsuper`, gguf_import.py) and N is a multiple of 256: activations quantised with one step xs a
super-block, refined per 32 by a power of two e_j in 1..8 (`super_block_rows`), and, as llama.cpp's
Q4_K x Q8_K product,

    y = sum_b xs_b * (d_b * sum_j e_j sc_j (q_j . xq_j) - dmin_b * sum_j mn_j e_j bsum_j)

with bsum_j the int8 sum of sub-block j's activations, everything inside the brackets integer: one
float conversion a super-block instead of a multiply and two FMAs a group of 32 (what a verification
block's extra rows cost). The powers of two keep most of the per-32 steps' precision: with one step
per 256 alone, the outliers of a super-block coarsened all its activations (the 1.5B's held-out
perplexity +1.0% against +0.0% per 32). DRAFTWISE_Q4K=0 keeps such weights as int4 groups of 32.

Used where the kernels were built with AVX-512 VNNI (`cpu_kernels.vnni()`) for GGUF blocks kept as
they are (loader.py); DRAFTWISE_ACT8=0 keeps the float-activation products.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import cpu_kernels

GROUP = 32
SUPER = 256  # inputs per Q4_K super-block


def enabled() -> bool:
    return cpu_kernels.vnni()


def row_block(model: torch.nn.Module) -> int:
    """The rows one pass over the model's weights serves: `cpu_kernels.AMX_TILE_ROWS` where its
    byte products run on AMX tiles (a 17th row costs a second pass: a step cost model's cue,
    policies/cost.py's `OnlineCost`), 0 where a step's cost grows smoothly with its rows."""
    if not cpu_kernels.amx_rows() or not any(getattr(m, "act8", False) for m in model.modules()):
        return 0
    return cpu_kernels.AMX_TILE_ROWS


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x [.., N] -> float32 [.., N]: each group of 32 as its int8 values times its step (what the
    kernels multiply, rounded the same way: x / step, to nearest even)."""
    shape = x.shape
    g = x.float().reshape(-1, shape[-1] // GROUP, GROUP)
    step = g.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(step > 0, torch.round(g / torch.where(step > 0, step, torch.ones_like(step))), torch.zeros_like(g))
    return (q * step).reshape(shape)


def super_blocks_wanted(n: int) -> bool:
    """Whether a kept Q4_K weight of n inputs runs as super-blocks (`dw_linear_q4k_a8`)."""
    return enabled() and n % SUPER == 0 and os.environ.get("DRAFTWISE_Q4K", "1") != "0"


def _int8_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [.., N] -> (q [.., N/group, group] float32 holding int8 values, step [.., N/group, 1])."""
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    step = g.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(step > 0, torch.round(g / torch.where(step > 0, step, torch.ones_like(step))), torch.zeros_like(g))
    return q, step


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


def q4k_steps(sub: torch.Tensor, sup: torch.Tensor) -> torch.Tensor:
    """Integer sub-scales (sub [O, N/32, 2] uint8: sc, mn; sup [O, N/256, 2] float16: d, dmin) -> the
    int4 groups' (step, minimum) [O, N/32, 2] float16: d * sc and -(dmin * mn) rounded to float16
    (gguf_blocks.q4k_blocks' values)."""
    o, g = sub.shape[:2]
    ds = sup.float().repeat_interleave(SUPER // GROUP, dim=1)  # [O, G, 2]
    sf = sub.float()
    return torch.stack([ds[..., 0] * sf[..., 0], -(ds[..., 1] * sf[..., 1])], dim=-1).half().reshape(o, g, 2)


def pack_q4k(q: torch.Tensor, sub: torch.Tensor, sup: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [O, N/2] uint8, sub [O, N/32, 2] uint8, sup [O, N/256, 2] float16) -> (qv as pack_q4's, ks
    [ceil(O/16), N/256, 320] uint8: per 16 outputs and super-block sc [8][16], mn [4][16][2], d [16]
    and dmin [16] float16)."""
    s = sup.shape[1]
    qv = _padded(q).reshape(-1, 16, s * 8, 4, 4).permute(0, 2, 3, 1, 4).contiguous()
    subp, supp = _padded(sub), _padded(sup)
    sc = subp[..., 0].reshape(-1, 16, s, 8).permute(0, 2, 3, 1).reshape(-1, s, 128)
    mn = subp[..., 1].reshape(-1, 16, s, 4, 2).permute(0, 2, 3, 1, 4).reshape(-1, s, 128)
    dd = supp.reshape(-1, 16, s, 2).permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(-1, s, 64)
    return qv, torch.cat([sc, mn, dd], dim=-1).contiguous()


def unpack_q4k(qv: torch.Tensor, ks: torch.Tensor, o: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_q4k's inverse: (q [O, N/2], sub [O, N/32, 2], sup [O, N/256, 2])."""
    b, s = ks.shape[:2]
    q = qv.permute(0, 3, 1, 2, 4).reshape(b * 16, s * 8 * 16)[:o]
    sc = ks[..., :128].reshape(b, s, 8, 16).permute(0, 3, 1, 2)
    mn = ks[..., 128:256].reshape(b, s, 4, 16, 2).permute(0, 3, 1, 2, 4).reshape(b, 16, s, 8)
    sub = torch.stack([sc, mn], dim=-1).reshape(b * 16, s * 8, 2)[:o]
    sup = ks[..., 256:].contiguous().view(torch.float16).reshape(b, s, 2, 16).permute(0, 3, 1, 2)
    return q.contiguous(), sub.contiguous(), sup.reshape(b * 16, s, 2)[:o].contiguous()


def super_block_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, N] -> (xq [R, N/256, 8, 32] float32 holding int8 values, e [R, N/256, 8], xs [R, N/256, 1]):
    a super-block's step a = max|x| / 127, sub-block j's a / 2^k_j with k_j in 0..3 the largest such
    that max|x_j| * 2^k_j <= max|x| (a finer grid where the super-block's outliers are not), e_j =
    2^(3 - k_j) and xs = a / 8, so that x ~ xs * e_j * xq (what dw_linear_q4k_a8 multiplies)."""
    g = x.float().reshape(x.shape[0], -1, 8, GROUP)
    gmax = g.abs().amax(dim=-1)  # [R, S, 8]
    amax = gmax.amax(dim=-1, keepdim=True)  # [R, S, 1]
    step = amax / 127.0
    k = sum((gmax * 2.0 ** t <= amax).int() for t in (1, 2, 3))  # [R, S, 8]
    sj = (step * 2.0 ** -k.float())[..., None]  # exact: powers of two
    q = torch.where(sj > 0, torch.round(g / torch.where(sj > 0, sj, torch.ones_like(sj))), torch.zeros_like(g))
    return q, 2.0 ** (3 - k).float(), step * 0.125


def q4k_reference(x: torch.Tensor, q: torch.Tensor, sub: torch.Tensor, sup: torch.Tensor, bias) -> torch.Tensor:
    """float32 [.., O]: dw_linear_q4k_a8's arithmetic step by step (`super_block_rows`). Integer sums
    (exact in float64), then per super-block t = float(isc) * d, t = t - float(imn) * dmin (one
    rounding, the FMA), y = t * xs + y (one rounding), super-blocks in order; the bias last."""
    o, n = q.shape[0], 2 * q.shape[1]
    s = n // SUPER
    xq, e, xs = super_block_rows(x.reshape(-1, n))  # [R, S, 8, 32], [R, S, 8], [R, S, 1]
    xq, e = xq.double(), e.double()
    b = q.reshape(o, s, 8, GROUP // 2)
    vals = torch.cat([b & 15, b >> 4], dim=-1).double()  # [O, S, 8, 32]
    dots = torch.einsum("rsjk,osjk->rosj", xq, vals)  # [R, O, S, 8], exact
    sc, mn = sub[..., 0].double().reshape(o, s, 8), sub[..., 1].double().reshape(o, s, 8)
    isc = (dots * sc * e[:, None]).sum(-1)  # [R, O, S]
    imn = ((xq.sum(-1) * e)[:, None] * mn).sum(-1)
    d, dmin = sup[..., 0].float(), sup[..., 1].float()  # [O, S]
    y = torch.zeros(xq.shape[0], o)
    for i in range(s):
        t = isc[..., i].float() * d[:, i]
        t = (t.double() - imn[..., i].float().double() * dmin[:, i].double()).float()
        y = (t.double() * xs[:, i].double() + y.double()).float()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], o)


def run(kind: str, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias, out_features: int,
        out_dtype: torch.dtype) -> torch.Tensor:
    """x [.., N] through vnni.c's product of `kind` ("q8g", "q4" or "q4k") into out_dtype [.., O]."""
    k = cpu_kernels.kernels()
    x = x.contiguous()
    n = x.shape[-1]
    out = torch.empty(*x.shape[:-1], out_features, dtype=out_dtype)
    fn = {"q8g": k.gemm_q8g_a8, "q4": k.linear_q4_a8, "q4k": k.linear_q4k_a8}[kind]
    fn(x.data_ptr(), w.data_ptr(), scale.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
       x.numel() // n, out_features, n, torch.get_num_threads(), int(x.dtype == torch.bfloat16),
       int(out_dtype == torch.bfloat16))
    return out
