"""Weights prepared once for the CPU product kernels: `PackedLinear` and `PackedEmbedding`.

A prepared projection runs in one of four ways, chosen when it is built:

- packed for the kernels' `dw_gemm_f32` / `dw_gemm_bf16` (`native`, layout `[ceil(O/16), N, 16]`)
  where the kernels are built and, on CPUs without AVX-512, their products equal oneDNN's bitwise;
- reordered once into oneDNN's blocked layout (`packed`) for the other large weights;
- kept transposed for the kernels' small-weight loop (`dw_linear`, up to 16 rows);
- a plain `F.linear` otherwise.

Batch-1 decoding is bound by reading the weights, so each product takes whichever reads them
fastest; every one of them gives a row's result independently of the other rows.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import cpu_kernels
from .quantize import dequantize_int4, dequantize_q8_groups

PACK_BATCH_HINT = 16  # oneDNN's expected rows per product when packing (the best of 1-64)
# Weights of at least this many elements are packed for oneDNN: batch-1 products are bound by
# reading them, and oneDNN reads them fastest. A oneDNN call has a fixed cost of tens of
# microseconds however small the weight (a bfloat16 F.linear as much), so smaller weights take
# the kernels' loop (`dw_linear`) for up to 16 rows, else F.linear. A lower boundary moved weights whose reading
# dominates into the loop and cost throughput; a higher one lost speculative decoding's gain.
PACK_MIN_NUMEL = 160_000
KERNEL_LINEAR_MAX_NUMEL = PACK_MIN_NUMEL
# where dw_gemm replaces oneDNN (`native_gemm_wanted`), weights from this size up are packed for it
# too: dw_gemm splits them across two threads (gemm_threads' threshold), the small-weight loop
# runs on one
NATIVE_MIN_NUMEL = 1 << 17
# oneDNN keeps ~0.5 MB for every (rows, weight shape) it has run, and never gives it back
# (ONEDNN_PRIMITIVE_CACHE_CAPACITY and LRU_CACHE_CAPACITY do not bound it). The same holds for
# bfloat16 `F.linear` (oneDNN's matmul), not for float32 `F.linear` (MKL).
# A server meets every row count from 1 to max_num_batched_tokens over hours, so products of more
# than EXACT_ROWS rows are padded to the next of 8 sizes per octave (16, 18, 20, ..., 30, 32, 36,
# ...): at most 12.5% more rows, ~70 shapes per weight up to 4096 rows, all met during warm-up.
EXACT_ROWS = 16
# outputs of a weight that `_native_pack` compares against oneDNN (each output's sum is its own)
PROBE_OUTPUTS = 64


def padded_rows(rows: int) -> int:
    """The row count a packed product of `rows` rows runs with (see EXACT_ROWS)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << max(0, rows.bit_length() - 4)  # 8 steps per octave [2^(b-1), 2^b)
    return -(-rows // step) * step


def native_gemm_wanted() -> bool:
    """dw_gemm_f32 / dw_gemm_bf16 instead of oneDNN for float weights (`_native_pack`,
    `_packable`): kernels built, not switched off (DRAFTWISE_NATIVE_GEMM=0)."""
    if os.environ.get("DRAFTWISE_NATIVE_GEMM", "1") == "0":
        return False
    return cpu_kernels.kernels() is not None


def _packable(w: torch.Tensor) -> bool:
    """oneDNN's packed layout: float32 on any CPU (`_native_pack` may still take it), bfloat16 only
    where the CPU multiplies it natively (`cpu_kernels.bf16_native`: oneDNN refuses to reorder a
    bfloat16 weight on an AVX2-only CPU) and the kernels' dw_gemm_bf16 is not used (with it a
    target's step is one kernel call, which outruns oneDNN's per-product calls;
    `benchmarks/peer_llamacpp.py` with and without DRAFTWISE_NATIVE_GEMM=0 compares the two)."""
    return (w.device.type == "cpu" and w.numel() >= PACK_MIN_NUMEL
            and (w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and cpu_kernels.bf16_native()
                                              and not native_gemm_wanted()))
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _native_pack(w: torch.Tensor, bias) -> torch.Tensor | None:
    """w packed for dw_gemm_f32 ([ceil(O/16), N, 16]) when `native_gemm_wanted` and its products
    equal oneDNN's bitwise on probe rows (1 and 7: the register blockings of one row and of
    several), else None. oneDNN packs only the first PROBE_OUTPUTS outputs for the check (each
    output's sum is its own: the check needs no second copy of a large weight in memory). Equal
    results make the switch invisible: the same logits, the same greedy tokens, only faster
    (oneDNN's small-row products leave memory bandwidth unused; `benchmarks/native_gemm.py`).

    With AVX-512 oneDNN's wider kernels sum some shapes in another order: there dw_gemm_f32 takes
    every float32 weight unchecked, for every row count, so that a row's bits never depend on the
    other rows (verification blocks and single steps agree) and the target's step is one kernel
    call (`dw_forward`)."""
    if w.dtype != torch.float32 or not native_gemm_wanted():
        return None
    O, N = w.shape
    wp = _pack(w)
    if cpu_kernels.avx512():
        return wp
    g = torch.Generator().manual_seed(O * 31 + N)
    n = min(O, PROBE_OUTPUTS)
    probe = torch.ops.mkldnn._reorder_linear_weight(w[:n].contiguous(), PACK_BATCH_HINT)
    for rows in (1, 7):
        x = torch.randn(rows, N, generator=g)
        ref = torch.ops.mkldnn._linear_pointwise(x, probe, None if bias is None else bias[:n].contiguous(),
                                                 "none", [], "")
        if not torch.equal(_native_linear(x, wp, bias, O)[:, :n], ref):
            return None
    return wp


def _pack(w: torch.Tensor) -> torch.Tensor:
    """w [O, N] in dw_gemm's layout [ceil(O/16), N, 16] (the missing outputs of the last block zero)."""
    wp = torch.empty((w.shape[0] + 15) // 16, w.shape[1], 16, dtype=w.dtype)
    cpu_kernels.kernels().pack(w.contiguous().data_ptr(), wp.data_ptr(), *w.shape, w.element_size())
    return wp


def _native_linear(x: torch.Tensor, wp: torch.Tensor, bias, out_features: int) -> torch.Tensor:
    """x times a weight packed for dw_gemm_f32 (float32) or dw_gemm_bf16 (bfloat16: x, bias and
    the result in bfloat16 too)."""
    k = cpu_kernels.kernels()
    n_in = wp.shape[1]
    if k is None or x.dtype != wp.dtype:  # kernels switched off since loading (tests): the same sum in torch
        w = wp.permute(0, 2, 1).reshape(-1, n_in)[:out_features]
        return F.linear(x.to(w.dtype), w, bias)
    x = x.contiguous()
    out = torch.empty(*x.shape[:-1], out_features, dtype=wp.dtype)
    gemm = k.gemm_f32 if wp.dtype == torch.float32 else k.gemm_bf16
    gemm(x.data_ptr(), wp.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
         x.numel() // n_in, out_features, n_in, torch.get_num_threads())
    return out


class PackedLinear(nn.Module):
    """Inference-only linear layer. On CPU a large enough weight is packed once for dw_gemm
    (`native`) or reordered into oneDNN's blocked layout (`packed`); a smaller one runs up to 16
    rows in the fused kernels' loop (`dw_linear`, see PACK_MIN_NUMEL); otherwise it is a plain
    `F.linear`.

    Why: batch-1 decoding is bound by reading the weights, and `F.linear` (MKL) reads them at a
    fraction of the memory bandwidth at a few rows; the packed products read them about twice as
    fast. Results differ from `F.linear` only by float rounding (~1e-6 relative), and a row's
    result does not depend on the other rows.
    Fused projections (q/k/v, gate/up) pass several weights, concatenated along the outputs.
    """

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None, native: bool = False):
        """`native`: dw_gemm's packing whatever the weight's size, where the kernels run and take its
        dtype (a head the fused kernels read, e.g. model/eagle3_vocab.py's)."""
        super().__init__()
        w = torch.cat(weights) if len(weights) > 1 else weights[0]
        self.out_features, self.in_features = w.shape
        self.bias = None if biases is None else nn.Parameter(torch.cat(biases), requires_grad=False)
        self.native = None  # dw_gemm_f32's packed weight, where it replaces oneDNN (see _native_pack)
        if _packable(w) and not native:  # an opaque oneDNN tensor: kept as a plain attribute, not a parameter
            self.packed, self.weight = None, None
            self.native = _native_pack(w, self.bias)
            if self.native is None:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_BATCH_HINT)
        elif (w.dtype in (torch.float32, torch.bfloat16) and w.device.type == "cpu"
              and ((w.numel() >= NATIVE_MIN_NUMEL and native_gemm_wanted())
                   or (native and cpu_kernels.kernels() is not None))):
            # bfloat16 without native bfloat16 products here (dw_gemm_bf16), or a weight below
            # oneDNN's threshold but big enough for two threads: dw_gemm rather than the
            # single-threaded small-weight loop, and every product of such a target packed (its
            # step is one call, any rows)
            self.packed, self.weight = None, None
            self.native = _pack(w)
        else:
            self.packed, self.weight = None, nn.Parameter(w.contiguous(), requires_grad=False)
        # a few rows through a small CPU weight: the fused kernels' loop (see cpu_kernels.py), which
        # reads the weight transposed ([in, out], a copy: these weights are small)
        self.small = (self.packed is None and self.native is None and w.device.type == "cpu"
                      and w.numel() < KERNEL_LINEAR_MAX_NUMEL
                      and w.dtype in (torch.float32, torch.bfloat16))
        self.weight_t = w.t().contiguous() if self.small else None

    @property
    def is_packed(self) -> bool:
        """Packed for a CPU product kernel: oneDNN's layout or dw_gemm_f32's."""
        return self.packed is not None or self.native is not None

    @staticmethod
    def of(*linears: nn.Linear, native: bool = False) -> "PackedLinear":
        has_bias = linears[0].bias is not None
        return PackedLinear([l.weight.detach() for l in linears],
                            [l.bias.detach() for l in linears] if has_bias else None, native=native)

    def forward(self, x):
        if self.native is not None:
            return _native_linear(x, self.native, self.bias, self.out_features)
        if self.packed is not None:
            return self._padded(x, lambda xp: torch.ops.mkldnn._linear_pointwise(xp, self.packed, self.bias, "none", [], ""))
        if self.small and x.dtype == self.weight.dtype and x.is_contiguous() and x.numel() <= 16 * self.in_features:
            k = cpu_kernels.kernels()
            if k is not None:
                out = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype)
                k.linear(x.data_ptr(), self.weight_t.data_ptr(), 0 if self.bias is None else self.bias.data_ptr(),
                         out.data_ptr(), x.numel() // self.in_features, self.out_features, self.in_features,
                         int(x.dtype == torch.bfloat16))
                return out
        if x.dtype == torch.bfloat16 and x.device.type == "cpu":  # oneDNN's matmul: see EXACT_ROWS
            return self._padded(x, lambda xp: F.linear(xp, self.weight, self.bias))
        return F.linear(x, self.weight, self.bias)

    def float_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """x times a bfloat16 weight packed for dw_gemm_bf16, the results in float32 without the
        rounding to bfloat16 (dw_gemm_bf16_f32out), or None where that kernel does not run this
        layer (another dtype or layout, the kernels switched off)."""
        k = cpu_kernels.kernels()
        if (k is None or self.native is None or self.native.dtype != torch.bfloat16
                or x.dtype != torch.bfloat16 or x.device.type != "cpu"):
            return None
        x = x.contiguous()
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32)
        k.gemm_bf16_f32out(x.data_ptr(), self.native.data_ptr(), 0 if self.bias is None else self.bias.data_ptr(),
                           out.data_ptr(), x.numel() // self.in_features, self.out_features, self.in_features,
                           torch.get_num_threads())
        return out

    def _padded(self, x, product):
        """`product` of x's rows padded with zero rows to `padded_rows` (a bounded set of shapes
        for oneDNN, see EXACT_ROWS); the padding's results are dropped."""
        rows = x.numel() // self.in_features
        padded = padded_rows(rows)
        if padded == rows:
            return product(x)
        xp = x.new_zeros(padded, self.in_features)  # [padded, in]
        xp[:rows] = x.reshape(rows, self.in_features)
        return product(xp)[:rows].view(*x.shape[:-1], self.out_features)


def kernel_product(p, dtype: torch.dtype):
    """(kind, weight, bias, scale) of `p` as the fused kernels' dw_product takes them (kernels/decoder.c:
    1 dw_gemm_f32, 2 dw_gemm_bf16, 0 the small-weight loop, up to 16 rows), or None where `p` is not
    a `PackedLinear` in one of those forms in `dtype`."""
    if not isinstance(p, PackedLinear):
        return None
    bias = 0 if p.bias is None else p.bias.data_ptr()
    if p.native is not None and p.native.dtype == dtype:
        return (1 if dtype == torch.float32 else 2), p.native.data_ptr(), bias, 0
    if p.small and p.weight.dtype == dtype:
        return 0, p.weight_t.data_ptr(), bias, 0
    return None


class PackedEmbedding(nn.Module):
    """A tied model's input embedding read from its LM head's dw_gemm_f32 packing ([ceil(V/16), N,
    16]: token t's row is [t // 16, :, t % 16]): the same values, without a second copy of the
    embedding matrix beside the head's packed one."""

    def __init__(self, packed: torch.Tensor):
        super().__init__()
        self.packed = packed  # a plain attribute: the head owns it

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.packed[input_ids // 16, :, input_ids % 16]


class QuantizedEmbedding(nn.Module):
    """An input embedding kept as a GGUF's blocks (loader.py): int4 (q [V, N/2], step and minimum
    [V, N/32, 2]) or int8 in groups (q [V, N], scales [V, N/32]); a lookup dequantises only the rows
    it reads. Why: Qwen2.5's 151,936 x 1536 table is 0.9 GB in float32, 0.15-0.23 GB as blocks, and a
    step reads one row per token."""

    def __init__(self, kind: str, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.kind, self.dtype = kind, dtype
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.num_embeddings = q.shape[0]
        self.embedding_dim = q.shape[1] * (2 if kind == "int4" else 1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., N], a new tensor
        flat = input_ids.reshape(-1)
        deq = dequantize_int4 if self.kind == "int4" else dequantize_q8_groups
        rows = deq(self.qweight[flat], self.scale[flat])  # [T, N] float32
        return rows.to(self.dtype).view(*input_ids.shape, self.embedding_dim)
