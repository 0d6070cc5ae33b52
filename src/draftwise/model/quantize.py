"""Weight-only quantization: int8 per output channel (`--quantization int8`), int4 in groups of 32
(`--quantization int4`).

A weight `w [O, N]` becomes `q = round(w / s)` in int8 (-127..127) with one float32 scale per
output channel, `s[o] = max|w[o, :]| / 127`, computed at load time from the float weights. The
activations stay in the model's dtype (float32 or bfloat16); a product is `y = s * (x . q) + b`,
accumulated in float32.

Why: batch-1 decoding and verification on CPU are bound by reading the weights, and int8 reads
one byte per weight (float32 four, bfloat16 two). torch's `_weight_int8pack_mm` was many times
slower than the oneDNN-packed float product at a few rows, so a few rows (`KERNEL_MAX_ROWS`: decode
steps, verification blocks) run the kernels' `dw_gemm_q8` (kernels/gemm.c): the int8 weight in
dw_gemm's packed layout (for each input the weights of 16 outputs side by side: one stream per 16
outputs, which reads faster than a row-major int8 weight), widened to float in registers,
dw_gemm_f32's FMA chains, then the channel's scale. More rows (prefill chunks, large batches)
take the reference path: the weight dequantised to float32 for that call, then `F.linear`.

Both paths compute in float32 (a bfloat16 activation is exact in float32; the result is rounded to
bfloat16 once) and differ by summation order only; `tests/test_quantize.py` compares them. The
kernel's rows are independent of each other (a token's result is bitwise the same alone or in a
verification block), so greedy speculative decoding still equals greedy plain decoding.

What is quantized: every decoder projection (fused q/k/v, o, fused gate/up, down) and the LM head
(for the embedded 20M target the largest product, 8192 x 384; for a tied model the head is a copy
of the embeddings anyway). The LM head's outputs stay float32 (no bfloat16 rounding of logits, so
no refinement by head_precision.py is needed). The embedding table stays float: a lookup reads one
row per token. Norms, RoPE, attention and the K/V cache are untouched.

int4 (`Int4Linear`): each output channel's weights in groups of 32 inputs, `w = d * q + m` with q in
0..15 and the group's step d and minimum m in float16 (llama.cpp's Q4_1: 0.625 bytes a weight);
the kernels' `dw_linear_q4` (kernels/linear.c) for a few rows, the dequantised float32 product for more. The LM head
stays int8 with `--quantization int4` (the logits' precision; llama.cpp's Q4 files keep the output
matrix at a higher precision too). A weight whose inputs are not a multiple of 32 stays int8.

Kept GGUF blocks (`import-gguf --keep-quantized`, loader.py): Q4_0/Q4_1 projections become
`Int4Linear`s holding the file's blocks; Q8_0 ones `Int8Linear`s with `group = 32` (a float16
scale per 32 inputs, w = d * q, packed like the weights), run by `dw_gemm_q8g`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import act8, cpu_kernels

METHODS = ("int8", "int4")
GROUP = 32  # int4: inputs per group (one step and minimum each)
KERNEL_MAX_ROWS = 16  # more rows (prefill chunks, large batches): the dequantised reference path


def check_method(method: str | None) -> str | None:
    """None or 'none' -> None; a known method -> itself; else a ValueError naming the choices."""
    if method in (None, "", "none"):
        return None
    if method not in METHODS:
        raise ValueError(f"quantization must be one of none, {', '.join(METHODS)}; got {method!r}")
    return method


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, N] float -> (q [O, N] int8, scale [O] float32): symmetric, per output channel."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / 127.0  # [O]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: q = 0, any scale
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_q8_groups(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """(q [O, N] int8, d [O, N/GROUP] float16: Q8_0's blocks) -> the float32 weight [O, N]."""
    o, n = q.shape
    return (q.float().reshape(o, n // GROUP, GROUP) * d.float()[..., None]).reshape(o, n)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [O, N] int8, scale [O]) -> the float32 weight [O, N] the products use."""
    return q.float() * scale[:, None]


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                          out_dtype: torch.dtype) -> torch.Tensor:
    """The pure-PyTorch product: x [.., N] @ dequantised weight, in float32, rounded to out_dtype."""
    return F.linear(x.float(), dequantize_int8(q, scale), bias).to(out_dtype)


class Int8Linear(nn.Module):
    """Inference-only int8 linear layer, a drop-in for `PackedLinear` (packed_weights.py) after
    `fuse_projections(quantization="int8")`. Fused projections pass several layers,
    concatenated along the outputs (each output channel keeps its own scale).

    `float_out`: outputs in float32 whatever the activations' dtype (the LM head: logits).
    `small = False` and `packed = None` tell the fused path that this is neither a small-weight
    loop's weight nor a oneDNN one: `NativeForward._layer_pointers` gives `dw_decoder` its
    dw_gemm_q8 kind."""

    small = False
    packed = None

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None,
                 float_out: bool = False, blocks: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        super().__init__()
        self.group = 0  # inputs per scale: 0 = one scale per output channel
        if blocks is not None:  # already int8 in groups (a GGUF's Q8_0 blocks, loader.py): kept as they are
            q, gs = (torch.cat(t) for t in zip(*blocks))  # [O, N] int8, [O, N/GROUP] float16
            self.group = GROUP
        else:
            w = torch.cat(weights) if len(weights) > 1 else weights[0]
            q, scale = quantize_int8(w)
        self.out_features, self.in_features = q.shape
        # kept blocks on a VNNI build: int8 activations (act8.py), the weights in vnni.c's layout
        self.act8 = self.group > 0 and act8.enabled()
        o, n = q.shape
        if self.act8:
            self.register_buffer("qpacked", act8.pack_q8(q))
        else:
            # dw_gemm's layout [ceil(O/16), N, 16] (the missing outputs of the last block zero): for
            # each input the weights of 16 outputs side by side, one stream per 16 outputs
            if o % 16:  # (no copy for the padding where there is none: the head is 0.2 GB)
                q = torch.cat([q, torch.zeros((-o) % 16, n, dtype=torch.int8)])
            self.register_buffer("qpacked", q.reshape(-1, 16, n).permute(0, 2, 1).contiguous())
        if self.group:  # the group scales in the same layout: [ceil(O/16), N/GROUP, 16] float16
            gpad = torch.zeros((-o) % 16, n // GROUP, dtype=torch.float16)
            scale = torch.cat([gs.half(), gpad]).reshape(-1, 16, n // GROUP).permute(0, 2, 1).contiguous()
        self.register_buffer("scale", scale)  # [O] float32, or the group scales
        self.bias = None if biases is None else torch.cat([b.detach().float() for b in biases]).contiguous()
        self.float_out = float_out

    @property
    def qweight(self) -> torch.Tensor:
        """The int8 weight [O, N] (a view of the packed one: the reference path, tests)."""
        if self.act8:
            return act8.unpack_q8(self.qpacked, self.out_features)
        return self.qpacked.permute(0, 2, 1).reshape(-1, self.in_features)[: self.out_features]

    @property
    def kernel(self) -> tuple[int, torch.Tensor]:
        """(dw_decoder's product kind, the weight it reads): see kernels/decoder.c."""
        return (6 if self.act8 else 5 if self.group else 3), self.qpacked

    def group_scales(self) -> torch.Tensor:
        """The group scales [O, N/GROUP] float16 (kept blocks only), out of the kernels' layout."""
        return self.scale.permute(0, 2, 1).reshape(-1, self.in_features // self.group)[: self.out_features]

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [O, N] the products use."""
        if not self.group:
            return dequantize_int8(self.qweight, self.scale)
        return dequantize_q8_groups(self.qweight, self.group_scales())  # (group is always GROUP: Q8_0 blocks)

    @staticmethod
    def of(*linears: nn.Linear, float_out: bool = False) -> "Int8Linear":
        """`linears` fused along the outputs; when each carries `int8_blocks` (the loader's, from a
        directory stored with Q8_0 blocks), those blocks and their group scales, else the weights
        quantised here (one scale per output)."""
        has_bias = linears[0].bias is not None
        blocks = [getattr(l, "int8_blocks", None) for l in linears]
        return Int8Linear([l.weight.detach() for l in linears],
                          [l.bias.detach() for l in linears] if has_bias else None, float_out=float_out,
                          blocks=blocks if all(b is not None for b in blocks) else None)

    def forward(self, x):  # [.., N] -> [.., O]
        out_dtype = torch.float32 if self.float_out else x.dtype
        rows = x.numel() // self.in_features
        if (x.device.type == "cpu" and 0 < rows and (rows <= KERNEL_MAX_ROWS or self.act8)
                and cpu_kernels.usable(x.dtype) and out_dtype in (torch.float32, torch.bfloat16)):
            if self.act8:  # (any rows: byte products outrun a dequantised float32 weight, act8.py)
                return act8.run("q8g", x, self.qpacked, self.scale, self.bias, self.out_features, out_dtype)
            k = cpu_kernels.kernels()
            x = x.contiguous()
            out = torch.empty(*x.shape[:-1], self.out_features, dtype=out_dtype)
            fn = k.gemm_q8g if self.group else k.gemm_q8
            fn(x.data_ptr(), self.qpacked.data_ptr(), self.scale.data_ptr(),
               0 if self.bias is None else self.bias.data_ptr(), out.data_ptr(), rows, self.out_features,
               self.in_features, torch.get_num_threads(), int(x.dtype == torch.bfloat16), int(out_dtype == torch.bfloat16))
            return out
        if self.act8:
            return act8.q8_reference(x, self.dequantized(), self.bias).to(out_dtype)
        return F.linear(x.float(), self.dequantized(), self.bias).to(out_dtype)

    def extra_repr(self) -> str:
        kind = (f"groups of {self.group}" if self.group else "per-channel") + (", int8 activations" if self.act8 else "")
        return f"in={self.in_features}, out={self.out_features}, int8 {kind}, float_out={self.float_out}"



def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, N] float (N a multiple of GROUP) -> (q [O, N/2] uint8, sm [O, N/GROUP, 2] float16):
    per group of 32 inputs the step d = (max - min) / 15 and the minimum m, rounded to float16,
    and q = round((w - m) / d) in 0..15; byte i of a group's 16 holds q[i] (low nibble) and
    q[i + 16] (high nibble)."""
    o, n = w.shape
    if n % GROUP:
        raise ValueError(f"int4 needs the inputs in groups of {GROUP}; got {n}")
    g = w.detach().float().reshape(o, n // GROUP, GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    d = ((hi - lo) / 15.0).half()
    m = lo.half()
    df = d.float()
    q = torch.where(df[..., None] > 0, torch.round((g - m.float()[..., None]) / df[..., None].clamp_min(1e-30)),
                    torch.zeros_like(g)).clamp_(0, 15).to(torch.uint8)  # [O, G, 32]
    packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(o, n // 2)
    return packed.contiguous(), torch.stack([d, m], dim=-1).contiguous()


def dequantize_int4(q: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """(q [O, N/2] uint8, sm [O, N/GROUP, 2] float16) -> the float32 weight [O, N] the products use."""
    o = q.shape[0]
    b = q.reshape(o, -1, GROUP // 2)
    vals = torch.cat([b & 15, b >> 4], dim=-1).float()  # [O, G, 32]
    smf = sm.float()
    return (vals * smf[..., 0:1] + smf[..., 1:2]).reshape(o, -1)


class Int4Linear(nn.Module):
    """Inference-only int4 linear layer (group-wise, see quantize_int4), a drop-in for
    `PackedLinear` like `Int8Linear`; `scale` holds the groups' (step, minimum) pairs, the pointer
    `dw_decoder` passes as a projection's scale (kind 4: dw_linear_q4)."""

    small = False
    packed = None
    float_out = False

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None,
                 blocks: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 subscales: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        super().__init__()
        if blocks is not None:  # already int4 (a GGUF's Q4 blocks, loader.py): kept as they are
            q, sm = (torch.cat(t) for t in zip(*blocks))
            self.out_features, self.in_features = q.shape[0], 2 * q.shape[1]
        else:
            w = torch.cat(weights) if len(weights) > 1 else weights[0]
            self.out_features, self.in_features = w.shape
            q, sm = quantize_int4(w)
        self.act8 = blocks is not None and act8.enabled()  # kept blocks on a VNNI build (act8.py)
        # Q4_K blocks with their integer sub-scales (`subscales`: (sub, sup) per block): super-blocks
        self.super_blocks = self.act8 and subscales is not None and act8.super_blocks_wanted(self.in_features)
        if self.super_blocks:
            sub, sup = (torch.cat(t) for t in zip(*subscales))
            q, sm = act8.pack_q4k(q, sub, sup)
        elif self.act8:
            q, sm = act8.pack_q4(q, sm)
        self.register_buffer("qweight", q)  # [O, N/2] uint8 (act8: vnni.c's layout)
        self.register_buffer("scale", sm)  # [O, N/32, 2] float16 (act8: vnni.c's layout; super-blocks: sub-scales)
        self.bias = None if biases is None else torch.cat([b.detach().float() for b in biases]).contiguous()

    @staticmethod
    def of(*linears: nn.Linear) -> "Int4Linear":
        """`linears` fused along the outputs; when each carries `int4_blocks` (the loader's, from a
        directory stored int4), those blocks, else the weights quantised here."""
        has_bias = linears[0].bias is not None
        blocks = [getattr(l, "int4_blocks", None) for l in linears]
        return Int4Linear([l.weight.detach() for l in linears], [l.bias.detach() for l in linears] if has_bias else None,
                          blocks=blocks if all(b is not None for b in blocks) else None)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [O, N/2] uint8, sm [O, N/32, 2] float16) in quantize_int4's layout."""
        if self.super_blocks:
            q, sub, sup = act8.unpack_q4k(self.qweight, self.scale, self.out_features)
            return q, act8.q4k_steps(sub, sup)
        if self.act8:
            return act8.unpack_q4(self.qweight, self.scale, self.out_features)
        return self.qweight, self.scale

    @property
    def kernel(self) -> tuple[int, torch.Tensor]:
        """(dw_decoder's product kind, the weight it reads): see kernels/decoder.c."""
        return (8 if self.super_blocks else 7 if self.act8 else 4), self.qweight

    def forward(self, x):  # [.., N] -> [.., O]
        rows = x.numel() // self.in_features
        if self.act8 and x.device.type == "cpu" and rows > 0 and cpu_kernels.usable(x.dtype):  # any rows: act8.py
            return act8.run("q4k" if self.super_blocks else "q4", x, self.qweight, self.scale, self.bias,
                            self.out_features, x.dtype)
        if self.super_blocks:
            q, sub, sup = act8.unpack_q4k(self.qweight, self.scale, self.out_features)
            return act8.q4k_reference(x, q, sub, sup, self.bias).to(x.dtype)
        if self.act8:
            return act8.q4_reference(x, *self.blocks(), self.bias).to(x.dtype)
        if x.device.type == "cpu" and 0 < rows <= KERNEL_MAX_ROWS and cpu_kernels.usable(x.dtype):
            k = cpu_kernels.kernels()
            x = x.contiguous()
            out = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype)
            bf = int(x.dtype == torch.bfloat16)
            k.linear_q4(x.data_ptr(), self.qweight.data_ptr(), self.scale.data_ptr(),
                        0 if self.bias is None else self.bias.data_ptr(), out.data_ptr(), rows, self.out_features,
                        self.in_features, torch.get_num_threads(), bf, bf)
            return out
        return F.linear(x.float(), dequantize_int4(self.qweight, self.scale), self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int4 groups of {GROUP}" + (
            ", Q4_K super-blocks" if self.super_blocks else "") + (", int8 activations" if self.act8 else "")


def int8_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [O, N] (N a multiple of GROUP) -> (q [O, N] int8, d [O, N/GROUP] float16), the layout of
    Q8_0 blocks: symmetric per group, d = max|w| / 127 rounded to float16, q = round(w / d)."""
    w = torch.as_tensor(w).float()
    o, n = w.shape
    g = w.reshape(o, n // GROUP, GROUP)
    d = (g.abs().amax(dim=-1) / 127.0).half()  # [O, G]
    df = d.float()
    df = torch.where(df > 0, df, torch.ones_like(df))  # an all-zero group: q = 0
    q = torch.round(g / df[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(o, n).contiguous(), d.contiguous()


def float_weight(lin: nn.Module) -> torch.Tensor:
    """A linear's float weight [O, N] in its dtype: its stored blocks dequantised where the loader
    left the weight unmaterialised (on the meta device), else the weight itself."""
    w = lin.weight
    if not w.is_meta:
        return w.detach()
    if hasattr(lin, "int4_blocks"):
        return dequantize_int4(*lin.int4_blocks).to(w.dtype)
    return dequantize_q8_groups(*lin.int8_blocks).to(w.dtype)


def common_blocks(lins) -> tuple[str, list[tuple[torch.Tensor, torch.Tensor]]] | None:
    """The stored blocks of linears fused along their outputs, all of one kind, or None where none
    has any. Where kinds differ (a GGUF's Q4_K q/k beside a Q6_K v) all become int8 in groups: the
    int4 ones re-quantised from their values (a finer grid than theirs: near their values), rather
    than the int8 ones coarsened to 4 bits."""
    kinds = {k for lin in lins for k in ("int4", "int8") if hasattr(lin, f"{k}_blocks")}
    if not kinds:
        return None
    kind = "int4" if kinds == {"int4"} else "int8"
    out = []
    for lin in lins:
        b = getattr(lin, f"{kind}_blocks", None)
        if b is None:
            w = float_weight(lin)
            b = int8_groups(w) if kind == "int8" else quantize_int4(w)
        out.append(b)
    return kind, out


def quantization_of(model: nn.Module) -> str | None:
    """The weight-only quantization a prepared model runs with ("int4", "int8"), or None (float weights)."""
    mods = list(model.modules())
    if any(isinstance(m, Int4Linear) for m in mods):
        return "int4"
    return "int8" if any(isinstance(m, Int8Linear) for m in mods) else None
