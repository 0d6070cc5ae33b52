"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) in plain PyTorch.

Module and parameter names mirror Hugging Face's `LlamaForCausalLM`, so a checkpoint's
state dict loads without renaming. Two entry points share the weights:

- `forward(input_ids, positions, kv_cache, meta)`: inference over a padded batch `[B, T]` that
  reads and writes the paged K/V cache (see `model/attention.py`); returns hidden states. It
  needs a model prepared by `fuse_projections()` (load_model does it): fused q/k/v and gate/up,
  weights packed for oneDNN on CPU (`PackedLinear`), and each layer's projections gathered in a
  `LayerWeights` that the functional `paged_layer` reads without module calls.
- `forward(input_ids)` with no cache: full causal attention through the modules, used by
  training and scoring (prepared or not).

`compute_logits(hidden)` applies the final projection only where the caller needs logits.
References: Touvron et al. 2023 (Llama), Su et al. 2021 (RoPE), HF transformers modeling_llama.
"""
from __future__ import annotations

import ctypes
import math
import os
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import cpu_kernels
from .attention import AttentionMetadata, paged_attention, sdpa
from .config import ModelConfig
from .head_precision import refine_top_logits
from .quantize import GROUP, KERNEL_MAX_ROWS, Int4Linear, Int8Linear, check_method


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x, weight, eps: float):  # HF semantics: normalise in float32, cast back, then scale
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # one call (~9 against ~14 us)
        return torch.rms_norm(x, x.shape[-1:], weight, eps)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if not s:
        return inv
    if s["rope_type"] == "linear":
        return inv / float(s["factor"])
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between
    factor = float(s["factor"])
    lo, hi = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old = float(s.get("original_max_position_embeddings", 8192))
    lo_wavelen, hi_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > lo_wavelen, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < hi_wavelen) & ~(wavelen > lo_wavelen)
    return torch.where(medium, smoothed, scaled)


PACK_BATCH_HINT = 16  # oneDNN's expected rows per product when packing (measured best of 1-64)
# Weights of at least this many elements are packed for oneDNN: batch-1 products are bound by
# reading them, and oneDNN reads them fastest (384x2304 float32: 44 against F.linear's 85 us).
# A oneDNN call costs ~27 us however small the weight, and a bfloat16 F.linear as much, so
# smaller weights take `kernels.c`'s loop for up to 16 rows (the draft's 224x160: float32
# F.linear 6 us, bfloat16 29 us, packed 27 us either way), else F.linear. Measured on the
# shipped pair, one run each: the boundary at 160K against 100K (the target's 384x384 o_proj and
# the draft's 960x160 gate/up in the loop instead of oneDNN): plain 180 against 159 tok/s
# (float32), 315 against 281 (bfloat16); at 300K (the 640x384 qkv too) speculative decoding lost
# 4-13%.
PACK_MIN_NUMEL = 160_000
KERNEL_LINEAR_MAX_NUMEL = PACK_MIN_NUMEL
# where dw_gemm replaces oneDNN (`native_gemm_wanted`), weights from this size up are packed for it
# too: dw_gemm splits them across two threads (gemm_threads' threshold), the small-weight loop
# runs on one
NATIVE_MIN_NUMEL = 1 << 17
# --quantization int8 quantizes the projections of at least this many elements (and the LM head):
# smaller ones cost their call, not their bytes (the embedded draft: only its 8192x160 head
# becomes int8)
QUANT_MIN_NUMEL = PACK_MIN_NUMEL
# oneDNN keeps ~0.5 MB for every (rows, weight shape) it has run, and never gives it back
# (ONEDNN_PRIMITIVE_CACHE_CAPACITY and LRU_CACHE_CAPACITY do not bound it; measured: 120 distinct
# row counts x 4 weights -> +280 MB RSS after malloc_trim, the same rows again -> +0). The same
# holds for bfloat16 `F.linear` (oneDNN's matmul: 128 row counts x the draft's 4 small weights
# -> +300 MB), not for float32 `F.linear` (MKL: +10 MB).
# A server meets every row count from 1 to max_num_batched_tokens over hours, so products of more
# than EXACT_ROWS rows are padded to the next of 8 sizes per octave (16, 18, 20, ..., 30, 32, 36,
# ...): at most 12.5% more rows, ~70 shapes per weight up to 4096 rows, all met during warm-up.
EXACT_ROWS = 16


def padded_rows(rows: int) -> int:
    """The row count a packed product of `rows` rows runs with (see EXACT_ROWS)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << max(0, rows.bit_length() - 4)  # 8 steps per octave [2^(b-1), 2^b)
    return -(-rows // step) * step


def _packable(w: torch.Tensor) -> bool:
    """oneDNN's packed layout: float32 on any CPU (`_native_pack` may still take it), bfloat16 only
    where the CPU multiplies it natively (`cpu_kernels.bf16_native`: oneDNN refuses to reorder a
    bfloat16 weight on an AVX2-only CPU) and the kernels' dw_gemm_bf16 is not used (with it, the
    20M target's step is one kernel call on the AVX-512 BF16 EPYC too: `benchmarks/peer_llamacpp.py`
    in bfloat16, with and without DRAFTWISE_NATIVE_GEMM=0, plain 510 against 238 tok/s, with the
    draft 881 against 502)."""
    return (w.device.type == "cpu" and w.numel() >= PACK_MIN_NUMEL
            and (w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and cpu_kernels.bf16_native()
                                              and not native_gemm_wanted()))
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def native_gemm_wanted() -> bool:
    """dw_gemm_f32 / dw_gemm_bf16 instead of oneDNN for float weights (`_native_pack`,
    `_packable`): kernels built, not switched off (DRAFTWISE_NATIVE_GEMM=0)."""
    if os.environ.get("DRAFTWISE_NATIVE_GEMM", "1") == "0":
        return False
    return cpu_kernels.kernels() is not None


def _native_pack(w: torch.Tensor, bias) -> torch.Tensor | None:
    """w packed for dw_gemm_f32 ([ceil(O/16), N, 16]) when `native_gemm_wanted` and its products
    equal oneDNN's bitwise on probe rows (1 and 7: the register blockings of one row and of
    several), else None. oneDNN packs only the first PROBE_OUTPUTS outputs for the check (each
    output's sum is its own: the check needs no second copy of a large weight in memory). Equal
    results make the switch invisible: the same logits, the same greedy tokens, only faster
    (measured on the AVX2-only EPYC, 2 threads, SmolLM2-135M's 30 layers of products: 19.2
    against 26.7 ms at 1 row, 28.7 / 37.2 at 5, 57.3 / 61.0 at 16, 403.6 / 449.3 at 256; oneDNN's
    small-row products leave bandwidth unused; benchmarks/native_gemm.py).
    With AVX-512 oneDNN's wider kernels sum some shapes in another order (SmolLM2's 576 inputs,
    not the embedded target's 384): there dw_gemm_f32 takes every float32 weight unchecked, for
    every row count, so that a row's bits never depend on the other rows (verification blocks and
    single steps agree) and the target's step is one kernel call (`dw_forward`). On the AVX-512
    EPYC (2 threads, `benchmarks/native_gemm.py products`, best of 3, with the 16-lane blocks of
    kernels.c's gemm_block16): the 20M target's layer products (`--shapes target --layers 8`) 1.9
    against 3.4 ms at 1 row, 2.2 / 2.8 at 5, 3.1 / 3.9 at 16, 9.3 / 10.0 at 64; SmolLM2-135M's 30
    layers 14.6 / 23.6 at 1 row, 15.4 / 20.0 at 5, 23.4 / 28.3 at 16, 75.3 / 75.8 at 64; batch-1
    decoding of the embedded pair (`benchmarks/native_gemm.py decode --rounds 2`, the kernels'
    products against oneDNN's, the drafter bfloat16 in both; before the 16-lane blocks) 392 / 379
    against 181 / 169 tok/s plain (2.21x), 695 / 690 against 431 / 438 with the draft (1.59x)."""
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


PROBE_OUTPUTS = 64


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
    """Inference-only linear layer. On CPU a large enough weight is reordered once into oneDNN's
    blocked layout and applied with oneDNN's linear kernel; a smaller one runs up to 16 rows in the
    fused kernels' loop (`dw_linear`, see PACK_MIN_NUMEL); otherwise it is a plain `F.linear`.

    Why: batch-1 decoding is bound by reading the weights, and on the 2-core CPU this project is
    measured on, `F.linear` (MKL) read them at ~10 GB/s. For the 20M target's 33 products per
    token, 2 threads: float32 6.8 ms (1 row) / 7.5 ms (5 rows) with `F.linear`, 2.9 / 2.5 ms
    packed; bfloat16 2.6 / 2.9 ms against 1.3 / 1.4 ms. Results differ from `F.linear` only by
    float rounding (~1e-6 relative), and a row's result does not depend on the other rows.
    Fused projections (q/k/v, gate/up) pass several weights, concatenated along the outputs.
    """

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None):
        super().__init__()
        w = torch.cat(weights) if len(weights) > 1 else weights[0]
        self.out_features, self.in_features = w.shape
        self.bias = None if biases is None else nn.Parameter(torch.cat(biases), requires_grad=False)
        self.native = None  # dw_gemm_f32's packed weight, where it replaces oneDNN (see _native_pack)
        if _packable(w):  # an opaque oneDNN tensor: kept as a plain attribute, not a parameter
            self.packed, self.weight = None, None
            self.native = _native_pack(w, self.bias)
            if self.native is None:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_BATCH_HINT)
        elif (w.dtype in (torch.float32, torch.bfloat16) and w.device.type == "cpu"
              and w.numel() >= NATIVE_MIN_NUMEL and native_gemm_wanted()):
            # bfloat16 without native bfloat16 products here (dw_gemm_bf16), or a weight below
            # oneDNN's threshold but big enough for two threads: dw_gemm rather than the
            # single-threaded small-weight loop (the embedded target's o projection, the draft's
            # gate/up), and every product of such a target packed (its step is one call, any rows)
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
    def of(*linears: nn.Linear) -> "PackedLinear":
        has_bias = linears[0].bias is not None
        return PackedLinear([l.weight.detach() for l in linears],
                            [l.bias.detach() for l in linears] if has_bias else None)

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


class PackedEmbedding(nn.Module):
    """A tied model's input embedding read from its LM head's dw_gemm_f32 packing ([ceil(V/16), N,
    16]: token t's row is [t // 16, :, t % 16]): the same values, without the embedding matrix
    beside the head's packed copy (SmolLM2-135M: 113 MB less)."""

    def __init__(self, packed: torch.Tensor):
        super().__init__()
        self.packed = packed  # a plain attribute: the head owns it

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.packed[input_ids // 16, :, input_ids % 16]


def apply_rope(x, cos, sin_signed):
    """RoPE on `[..., D]`: `x * cos + rotate_half(x) * sin`, where rotate_half(x) = (-x2, x1) is
    computed as roll(x, D/2) * (-1, +1) with the sign folded into `sin_signed` (bitwise the same)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, Hkv, D, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(h, H * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, Hkv * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, Hkv * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * D, h, bias=cfg.attention_bias and cfg.arch != "qwen2")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.scale = D ** -0.5

    def forward(self, x, cos, sin):  # no cache: training and scoring (inference: `paged_layer`)
        B, T, _ = x.shape
        cfg = self.cfg
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if hasattr(self, "qkv_proj"):  # prepared for inference: one matmul instead of three
            qkv = self.qkv_proj(x).view(B, T, H + 2 * Hkv, D)
            q, k, v = qkv.split([H, Hkv, Hkv], dim=2)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # RoPE on q and k heads together: [B, T, H + Hkv, D] (positions broadcast over heads)
        qk = apply_rope(torch.cat((q, k), dim=2), cos, sin).to(x.dtype)
        q, k, v = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), v.transpose(1, 2)
        mask = None
        if cfg.sliding_window is not None and T > cfg.sliding_window:
            i = torch.arange(T, device=x.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - cfg.sliding_window)
        y = sdpa(q, k, v, mask, self.scale, is_causal=mask is None)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1).to(x.dtype))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)

    def forward(self, x):
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LayerWeights(NamedTuple):
    """One prepared decoder layer, read directly by `paged_layer` (no module calls: they cost
    ~0.5 ms per step of the 8-layer target on this CPU). Projections are `PackedLinear.forward`."""

    ln1: torch.Tensor
    qkv: Callable[[torch.Tensor], torch.Tensor]  # [.., hidden] -> [.., (H + 2 Hkv) * D]
    o: Callable[[torch.Tensor], torch.Tensor]
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    ln2: torch.Tensor
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]

    @staticmethod
    def of(layer: "DecoderLayer") -> "LayerWeights":
        a, m = layer.self_attn, layer.mlp
        return LayerWeights(
            layer.input_layernorm.weight, a.qkv_proj.forward, a.o_proj.forward,
            a.q_norm.weight if hasattr(a, "q_norm") else None, a.k_norm.weight if hasattr(a, "k_norm") else None,
            layer.post_attention_layernorm.weight, m.gate_up_proj.forward, m.down_proj.forward,
        )


def paged_layer(x, w: LayerWeights, cfg: ModelConfig, cos, sin, layer_cache, meta: AttentionMetadata):
    """One decoder layer over the paged K/V cache (inference): the same computation as
    `DecoderLayer.forward`, with K/V written to and read from `layer_cache`."""
    B, T, _ = x.shape
    H, Hkv, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    qkv = w.qkv(rms_norm(x, w.ln1, eps)).view(B, T, H + 2 * Hkv, D)
    qk, v = qkv[:, :, : H + Hkv], qkv[:, :, H + Hkv :]  # q and k heads are adjacent
    if w.q_norm is not None:
        qk = torch.cat((rms_norm(qk[:, :, :H], w.q_norm, eps), rms_norm(qk[:, :, H:], w.k_norm, eps)), dim=2)
    qk = apply_rope(qk, cos, sin).to(x.dtype)
    y = paged_attention(qk[:, :, :H].transpose(1, 2), qk[:, :, H:], v, layer_cache, meta, D ** -0.5)
    x = x + w.o(y.transpose(1, 2).reshape(B, T, -1).to(x.dtype))
    gate, up = w.gate_up(rms_norm(x, w.ln2, eps)).chunk(2, dim=-1)
    return x + w.down(F.silu(gate) * up)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.plan: list[LayerWeights] | None = None  # set by fuse_projections (inference)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # see rope()
        self._decoder_plan = None  # see _layer_pointers
        self._io = None  # see _native_io
        self._fit: tuple | None = None  # (kv cache key, _kernels_fit's answer for it)
        self.head_rows: torch.Tensor | None = None  # the head's weight once packed (refine_top_logits)
        self.refine_head = True  # bfloat16 heads: the top logits recomputed in float32 (head_precision.py)

    def rope(self, positions: torch.Tensor, max_position: int | None = None):
        """positions [B, T] -> cos, sin_signed [B, T, 1, D] (float32; see `apply_rope`).

        With `max_position` (an upper bound the caller knows, e.g. the longest sequence) the rows
        come from a table of positions 0..n-1 grown by doubling: two lookups instead of nine ops
        per forward (the same formula; vectorised sin/cos may round the last bit differently)."""
        if max_position is None:
            return self._rope_rows(positions)
        cos, sin = self.rope_table(max_position, positions.device)
        return cos[positions][:, :, None], sin[positions][:, :, None]

    def rope_table(self, max_position: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed for positions 0..n-1 (n > max_position), float32 `[n, D]`, contiguous."""
        if self._rope_table is None or self._rope_table[0].shape[0] <= max_position:
            n = 1 << max(6, max_position.bit_length())
            cos, sin = self._rope_rows(torch.arange(n, device=device)[None])
            self._rope_table = (cos[0, :, 0].contiguous(), sin[0, :, 0].contiguous())
        return self._rope_table

    def _rope_rows(self, positions: torch.Tensor):
        freqs = positions.float()[..., None] * self.inv_freq.float()  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return emb.cos()[:, :, None], sin[:, :, None]

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor | None = None,  # [B, T]
        kv_cache: torch.Tensor | None = None,  # [layers, 2, num_slots, Hkv, D]
        meta: AttentionMetadata | None = None,
        max_position: int | None = None,  # an upper bound of `positions`, if known (see rope)
    ) -> torch.Tensor:  # hidden [B, T, hidden]
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        if (kv_cache is not None and self.plan is not None and input_ids.device.type == "cpu"
                and self._fusable(*input_ids.shape, kv_cache, meta)):
            return self._fused_forward(input_ids, positions, kv_cache, meta, max_position)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, max_position)
        if kv_cache is None:
            for layer in self.model.layers:
                x = layer(x, cos, sin)
            return self.model.norm(x)
        if self.plan is None:
            raise RuntimeError("a forward over the paged K/V cache needs a model prepared for inference "
                               "(fuse_projections(); load_model does it)")
        for i, w in enumerate(self.plan):
            x = paged_layer(x, w, self.cfg, cos, sin, kv_cache[i], meta)
        return rms_norm(x, self.model.norm.weight, self.cfg.rms_norm_eps)

    # longer blocks (prefill chunks) take the PyTorch path, whose SDPA is blocked and multi-threaded:
    # a 20M target's prefill of 32 / 64 / 128 / 256 / 512 tokens took 7.5 / 12.9 / 24.5 / 51.6 /
    # 141.7 ms fused against 8.9 / 13.9 / 23.9 / 45.4 / 108.8 ms in PyTorch (float32; bfloat16
    # alike); with the attention split across threads (AVX2 EPYC, 2 threads), 128 tokens from
    # position 0 / 128: 31.8 / 35.4 ms fused, 34.9 / 38.0 PyTorch; 256: 65.3 / 79.3 against
    # 66.0 / 73.2; 512: 154.3 / 261.2 against 144.6 / 173.9. 128 is also the longest prefill chunk
    # of a step that decodes too (engine: `mixed`), which runs as one packed forward.
    FUSED_MAX_TOKENS = 128

    def _fusable(self, B: int, T: int, kv_cache, meta) -> bool:
        """Can B sequences of T new tokens on the CPU (`forward`, `native_logits` ask) run fused? With
        the kernels built (see cpu_kernels.py), at most FUSED_MAX_TOKENS new tokens per sequence,
        and either one sequence on consecutive cache slots (the runner sets
        `gather_start` only then, with positions L-T..L-1) or a batch whose sequences' key counts
        and new-token counts the runner gave (`seq_lens`, `seq_new`: sequence b's new tokens are
        its last keys, in its first rows; the other rows are padding)."""
        if meta.row_offsets is not None:  # packed rows: the runner asked `packs` first
            return True
        if T > self.FUSED_MAX_TOKENS:
            return False
        if not ((B == 1 and meta.gather_start is not None) or (meta.seq_lens is not None and len(meta.seq_lens) == B)):
            return False
        return self._kernels_fit(kv_cache)

    def _kernels_fit(self, kv_cache) -> bool:
        # the cache's layout, known per cache tensor (asked every step: ~25 us to work out again)
        key = (kv_cache.data_ptr(), kv_cache.dtype, kv_cache.shape, kv_cache.device)
        if self._fit is None or self._fit[0] != key:
            cfg = self.cfg
            self._fit = (key, self.plan is not None and not cfg.qk_norm and cfg.head_dim <= 1024
                         and kv_cache.dtype == self.model.norm.weight.dtype and kv_cache.is_contiguous()
                         and kv_cache.device.type == "cpu")
        return self._fit[1] and cpu_kernels.usable(kv_cache.dtype)

    def packs(self, max_new_tokens: int, kv_cache) -> bool:
        """Can a batch of sequences feeding different numbers of tokens run packed (one row per real
        token, no padding: `AttentionMetadata.row_offsets`)? Only on the fused CPU path, which
        attends each sequence's rows where they are; the PyTorch path takes a padded [B, T] batch."""
        return max_new_tokens <= self.FUSED_MAX_TOKENS and self._kernels_fit(kv_cache)

    def _decoder_args(self, B: int, T: int, pos_ptr: int, kv_cache, meta: AttentionMetadata, max_position):
        """dw_decoder's arguments after x and h (dw_forward's after its head and rows), and the objects
        they point into, to keep alive until the call: B sequences of T rows, or packed rows
        (`meta.row_offsets`); positions at `pos_ptr` (int64, one per row)."""
        cfg = self.cfg
        keep = []
        offs_p = 0
        if meta.row_offsets is not None:  # packed: [1, R] rows, sequence b's at row_offsets[b]..
            offs = (ctypes.c_int64 * len(meta.row_offsets))(*meta.row_offsets)
            keep.append(offs)
            offs_p, B, T = ctypes.addressof(offs), len(meta.seq_lens), 0
        L = meta.num_keys  # the longest sequence's
        cos, sin = self.rope_table(max(L, int(max_position or 0)), kv_cache.device)
        if meta.gather_start is not None and B == 1:  # consecutive slots
            slot0, Lmax, slots_p, lens_p, news_p = meta.gather_start, 0, 0, 0, 0
        else:  # paged: every key position's slot, per sequence; rows after a sequence's new tokens pad
            slots = meta.gather_slots  # (a view of wider rows, `KVManager.slots`: the row stride is the kernels' Lmax)
            if slots.stride(1) != 1 or (slots.shape[0] > 1 and slots.stride(0) < slots.shape[1]):
                slots = slots.contiguous()
            slot0 = 0
            lens_news = (ctypes.c_int64 * (2 * B))(*meta.seq_lens, *meta.seq_new)
            keep += [slots, lens_news]
            Lmax, slots_p = (slots.stride(0) if slots.shape[0] > 1 else slots.shape[1]), slots.data_ptr()
            lens_p = ctypes.addressof(lens_news)
            news_p = lens_p + 8 * B
        ptrs, kinds, _ = self._decoder_plan or (None, None, 0)  # (): no one-call plan, the per-layer path
        bf = int(kv_cache.dtype == torch.bfloat16)
        args = (B, T, len(self.plan), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                cfg.head_dim, cfg.intermediate_size, ptrs, kinds, self.model.norm.weight.data_ptr(), cfg.rms_norm_eps,
                pos_ptr, cos.data_ptr(), sin.data_ptr(), kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1),
                slot0, L, slots_p, Lmax, lens_p, news_p, offs_p, cfg.sliding_window or 0, cfg.head_dim ** -0.5, bf,
                torch.get_num_threads())
        return args, keep

    def _native_io(self):
        """(embedding pointer, packed?, head pointer, head kind) when the input embedding and the
        head run inside the kernels (`dw_forward`, `dw_draft_greedy`): an `nn.Embedding` of the
        model's dtype or the packed tied one, and a bias-free head packed for dw_gemm_f32 (kind 1,
        float32) or dw_gemm_bf16 with float32 logits (kind 2, bfloat16 with `refine_head`:
        compute_logits' float_logits); else None. The pointers are found once (prepared weights
        never move, see `_apply`), the kind every call (`refine_head` may change)."""
        if self._io is None:
            dtype, head, emb = self.model.norm.weight.dtype, self.lm_head, self.model.embed_tokens
            native = getattr(head, "native", None)
            io = ()
            if isinstance(head, PackedLinear) and native is not None and head.bias is None and native.dtype == dtype:
                if isinstance(emb, PackedEmbedding) and emb.packed.dtype == dtype == torch.float32:
                    io = (emb.packed.data_ptr(), 1, native.data_ptr(), dtype)
                elif type(emb) is nn.Embedding and emb.weight.dtype == dtype and emb.weight.is_contiguous():
                    io = (emb.weight.data_ptr(), 0, native.data_ptr(), dtype)
            self._io = io
        if not self._io:
            return None
        emb, packed, head, dtype = self._io
        kind = 1 if dtype == torch.float32 else 2 if dtype == torch.bfloat16 and self.refine_head else 0
        return (emb, packed, head, kind) if kind else None

    def native_logits(self, ids: list[int], positions: list[int], B: int, T: int, kv_cache,
                      meta: AttentionMetadata, max_position: int, rows: list[int]) -> torch.Tensor | None:
        """The logits [len(rows), V] (float32) of the listed rows of a step on the fused CPU path, in
        one kernel call (`dw_forward`: embeddings, every layer, the final norm, the head): what
        `forward` then `compute_logits` of those rows give, bit for bit, without their PyTorch calls
        (~0.4 ms of a batch-1 step, most of it the interpreter and PyTorch's dispatch run cold after
        the weights streamed through the caches). `ids` and `positions` hold one entry per row (B x T
        rows, or packed rows: `meta.row_offsets`). None where that call does not run this step
        (the kernels off, another layout, too many rows, a token outside the vocabulary: the
        step-by-step path raises the error): then the caller takes `forward`."""
        kern = cpu_kernels.kernels()
        if kern is None or self.plan is None or not rows or not self._fusable(B, T, kv_cache, meta):
            return None
        if self._decoder_plan is None:
            self._decoder_plan = self._layer_pointers()
        io = self._native_io()
        V = self.cfg.vocab_size
        if not self._decoder_plan or io is None or len(ids) > self._decoder_plan[2]:
            return None
        if min(ids) < 0 or max(ids) >= V:
            return None
        ids_c = (ctypes.c_int64 * len(ids))(*ids)
        pos_c = (ctypes.c_int64 * len(positions))(*positions)
        sel = (ctypes.c_int64 * len(rows))(*rows)
        args, keep = self._decoder_args(B, T, ctypes.addressof(pos_c), kv_cache, meta, max_position)
        logits = torch.empty(len(rows), V, dtype=torch.float32)
        emb, packed, head, kind = io
        rc = kern.forward(emb, packed, ctypes.addressof(ids_c), head, kind, V, ctypes.addressof(sel), len(rows),
                          logits.data_ptr(), *args)
        if rc != 0:
            raise MemoryError("fused forward: no scratch memory")
        return logits

    def _fused_forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata, max_position):
        """`paged_layer`'s computation in 5 kernel calls per layer besides the 4 products: RMSNorm,
        RoPE in place, attention with the K/V write, residual add + RMSNorm, SiLU-and-multiply
        (kernels.c), or every layer in one call (`dw_decoder`) where its products all run in the
        kernels. The residual stream `x` is updated in place. Rows are tokens: B sequences of T."""
        k = cpu_kernels.kernels()
        cfg = self.cfg
        B, T = input_ids.shape
        R = B * T
        pos = positions.contiguous()
        emb = self.model.embed_tokens  # [B, T, hidden], a new tensor: updated in place
        x = F.embedding(input_ids, emb.weight) if type(emb) is nn.Embedding else emb(input_ids)
        h = torch.empty_like(x)  # the normalised input of the next product
        if self._decoder_plan is None:
            self._decoder_plan = self._layer_pointers()
        args, keep = self._decoder_args(B, T, pos.data_ptr(), kv_cache, meta, max_position)
        if self._decoder_plan and R <= self._decoder_plan[2]:
            rc = k.decoder(x.data_ptr(), h.data_ptr(), *args)  # every layer in one call
            if rc != 0:
                raise MemoryError("fused decoder: no scratch memory")
            return h
        (B, T, _, hid, H, Hkv, D, _, _, _, _, eps, _, cos_p, sin_p, cache, layer_stride, kv_stride, slot0, L,
         slots_p, Lmax, lens_p, news_p, offs_p, window, scale, bf, threads) = args
        es = kv_cache.element_size()
        plan = self.plan
        k.rms_norm(x.data_ptr(), plan[0].ln1.data_ptr(), h.data_ptr(), R, hid, eps, bf)
        for i, w in enumerate(plan):
            qkv = w.qkv(h)  # [B, T, (H + 2 Hkv) * D]
            k.rope(qkv.data_ptr(), R, (H + 2 * Hkv) * D, H + Hkv, D, pos.data_ptr(), cos_p, sin_p, bf)
            y = torch.empty(*x.shape[:-1], H * D, dtype=x.dtype)
            kc = cache + i * layer_stride * es
            if not slots_p:  # consecutive slots
                rc = k.attend(qkv.data_ptr(), T, H, Hkv, D, kc, kc + kv_stride * es, slot0, L, window, scale,
                              y.data_ptr(), bf, threads)
            else:
                rc = k.attend_batch(qkv.data_ptr(), B, T, H, Hkv, D, kc, kc + kv_stride * es, slots_p, Lmax, lens_p,
                                    news_p, offs_p, window, scale, y.data_ptr(), bf, threads)
            if rc != 0:
                raise MemoryError("fused attention: no scratch memory")
            o = w.o(y)  # (held in a name: a temporary's memory could be freed before the call)
            k.add_rms_norm(x.data_ptr(), o.data_ptr(), w.ln2.data_ptr(), h.data_ptr(), R, hid, eps, bf)
            gu = w.gate_up(h)
            a = torch.empty(*x.shape[:-1], gu.shape[-1] // 2, dtype=x.dtype)
            k.silu_mul(gu.data_ptr(), a.data_ptr(), R, a.shape[-1], bf)
            nxt = plan[i + 1].ln1 if i + 1 < len(plan) else self.model.norm.weight
            d = w.down(a)
            k.add_rms_norm(x.data_ptr(), d.data_ptr(), nxt.data_ptr(), h.data_ptr(), R, hid, eps, bf)
        return h

    def _fused_steps(self, kv_cache: torch.Tensor, feeds: list[list[int]], ks: list[int]):
        """(kernels, `_native_io`) when the fused greedy steps can run here for sequences feeding
        `feeds` and drafting `ks` (each >= 1): every product the kernels' own, the embedding and the
        head inside them, each feed 1..FUSED_MAX_TOKENS tokens, the first step's rows within what the
        kernels take, every id inside the vocabulary (else the step-by-step path raises the error);
        None otherwise."""
        kern = cpu_kernels.kernels()
        if kern is None or self.plan is None or not self._kernels_fit(kv_cache) or not feeds or min(ks) < 1:
            return None
        if self._decoder_plan is None:
            self._decoder_plan = self._layer_pointers()
        lens = [len(f) for f in feeds]
        if not self._decoder_plan or sum(lens) > self._decoder_plan[2] or len(feeds) > self._decoder_plan[2] \
                or max(lens) > self.FUSED_MAX_TOKENS or min(lens) < 1:
            return None
        io = self._native_io()
        V = self.cfg.vocab_size
        if io is None or any(not 0 <= t < V for f in feeds for t in f):
            return None
        return kern, io

    def greedy_steps(self, feed: list[int], start: int, k: int, kv_cache: torch.Tensor, slot0: int | None,
                     slots: torch.Tensor | None, confidence: bool = False):
        """A drafter's k greedy steps for one sequence in one kernel call (`dw_draft_greedy`): feed
        `feed` at positions start.., take the last row's argmax, feed it, ... k times; the K/V of
        every fed token written (the k-th proposal is not fed). The calls `ModelRunner.run`, the
        head and the argmax make for such a row, with the same arguments: the same proposals,
        without ~0.25 ms of Python a step. slot0: the first slot when positions 0.. lie on
        consecutive slots, else `slots` holds each position's slot. Returns (tokens, max softmax
        probability per step or None), or None where this model's forward is not one call
        (another kernel layout, a bias on the head, too many tokens fed)."""
        fused = self._fused_steps(kv_cache, [feed], [k])
        if fused is None:
            return None
        kern, (emb_ptr, emb_packed, head_ptr, head_kind) = fused
        cfg, dtype = self.cfg, self.model.norm.weight.dtype
        n0 = len(feed)
        cos, sin = self.rope_table(start + n0 + k, kv_cache.device)
        ptrs, kinds, _ = self._decoder_plan
        feed_c = (ctypes.c_int64 * n0)(*feed)
        toks = (ctypes.c_int64 * k)()
        conf = (ctypes.c_float * k)() if confidence else None
        rc = kern.draft_greedy(
            emb_ptr, emb_packed, ctypes.addressof(feed_c), n0, start, k, len(self.plan), cfg.hidden_size,
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, ptrs, kinds,
            self.model.norm.weight.data_ptr(), cfg.rms_norm_eps, cos.data_ptr(), sin.data_ptr(), kv_cache.data_ptr(),
            kv_cache.stride(0), kv_cache.stride(1), -1 if slot0 is None else slot0,
            0 if slots is None else slots.data_ptr(), 0 if slots is None else slots.numel(), cfg.sliding_window or 0,
            cfg.head_dim ** -0.5, int(dtype == torch.bfloat16), torch.get_num_threads(), head_ptr, head_kind,
            cfg.vocab_size, ctypes.addressof(toks), 0 if conf is None else ctypes.addressof(conf))
        if rc != 0:
            raise MemoryError("fused draft steps: no scratch memory")
        return list(toks), (list(conf) if conf is not None else None)

    def greedy_steps_rows(self, feeds: list[list[int]], starts: list[int], ks: list[int], kv_cache: torch.Tensor,
                          slots: torch.Tensor, confidence: bool = False):
        """`greedy_steps` for B sequences at once (`dw_draft_greedy_rows`): sequence b feeds feeds[b]
        at positions starts[b].., then its proposals, ks[b] of them; each step is one packed forward
        of the sequences still drafting (what the drafter's loop runs for such rows, with the same
        values). slots [B, L]: each sequence's slot per position, reaching starts[b] + len(feeds[b])
        + ks[b] - 1. Returns (tokens per sequence, confidences per sequence or None), or None where
        this model's forward is not one call (as greedy_steps), or the first step's rows exceed
        what the kernels take."""
        fused = self._fused_steps(kv_cache, feeds, ks)
        if fused is None:
            return None
        kern, (emb_ptr, emb_packed, head_ptr, head_kind) = fused
        cfg, dtype = self.cfg, self.model.norm.weight.dtype
        flat = [t for f in feeds for t in f]
        n0, B, kmax = len(flat), len(feeds), max(ks)
        offs = [0]
        for f in feeds:
            offs.append(offs[-1] + len(f))
        cos, sin = self.rope_table(max(s + len(f) + k for s, f, k in zip(starts, feeds, ks)), kv_cache.device)
        ptrs, kinds, _ = self._decoder_plan
        feed_c = (ctypes.c_int64 * n0)(*flat)
        meta_c = (ctypes.c_int64 * (3 * B + 1))(*offs, *starts, *ks)
        slots = slots.contiguous()
        toks = (ctypes.c_int64 * (B * kmax))()
        conf = (ctypes.c_float * (B * kmax))() if confidence else None
        base = ctypes.addressof(meta_c)
        rc = kern.draft_greedy_rows(
            emb_ptr, emb_packed, ctypes.addressof(feed_c), base, base + 8 * (B + 1), base + 8 * (2 * B + 1), B,
            len(self.plan), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, ptrs, kinds, self.model.norm.weight.data_ptr(), cfg.rms_norm_eps, cos.data_ptr(),
            sin.data_ptr(), kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1), slots.data_ptr(),
            slots.shape[1], cfg.sliding_window or 0, cfg.head_dim ** -0.5, int(dtype == torch.bfloat16),
            torch.get_num_threads(), head_ptr, head_kind, cfg.vocab_size, kmax, ctypes.addressof(toks),
            0 if conf is None else ctypes.addressof(conf))
        if rc != 0:
            raise MemoryError("fused draft steps: no scratch memory")
        out = [list(toks[b * kmax : b * kmax + k]) for b, k in enumerate(ks)]
        return out, ([list(conf[b * kmax : b * kmax + k]) for b, k in enumerate(ks)] if conf is not None else None)

    def _layer_pointers(self):
        """For `dw_decoder` (every layer in one call): (14 pointers per layer, 4 product kinds per
        layer, the most rows it takes) when every projection runs in a kernel of kernels.c whatever
        the rows up to that bound (a small weight's dw_linear up to 16 rows, a dw_gemm packing any
        number, an int8 weight's dw_gemm_q8 and an int4 one's dw_linear_q4 up to KERNEL_MAX_ROWS), else () (the per-layer path:
        some product is oneDNN's, e.g. with DRAFTWISE_NATIVE_GEMM=0). The call makes the per-layer path's kernel
        calls in the same order with the same arguments: the same bits, without ~10 Python calls a
        layer (SmolLM2-135M: 300 a step). Prepared weights never move (see `_apply`), so the pointers
        stay valid. DRAFTWISE_NATIVE_STEP=0 keeps the per-layer path (benchmarks/native_gemm.py)."""
        if os.environ.get("DRAFTWISE_NATIVE_STEP", "1") == "0":
            return ()
        ptrs, kinds, max_rows = [], [], 1 << 30
        dtype = self.model.norm.weight.dtype
        for layer, w in zip(self.model.layers, self.plan):
            a, m = layer.self_attn, layer.mlp
            ptrs.append(w.ln1.data_ptr())
            for n, p in enumerate((a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)):
                bias = 0 if p.bias is None else p.bias.data_ptr()
                if isinstance(p, (Int8Linear, Int4Linear)) and not p.float_out:
                    kind, weight = (4, p.qweight) if isinstance(p, Int4Linear) else (5 if p.group else 3, p.qpacked)
                    weight, scale, max_rows = weight.data_ptr(), p.scale.data_ptr(), min(max_rows, KERNEL_MAX_ROWS)
                elif getattr(p, "native", None) is not None and p.native.dtype == dtype:
                    kind, weight, scale = (1 if dtype == torch.float32 else 2), p.native.data_ptr(), 0
                elif getattr(p, "small", False) and p.weight.dtype == dtype:
                    kind, weight, scale, max_rows = 0, p.weight_t.data_ptr(), 0, min(max_rows, 16)
                else:
                    return ()
                ptrs += [weight, bias, scale]
                kinds.append(kind)
                if n == 1:
                    ptrs.append(w.ln2.data_ptr())
        return (ctypes.c_void_p * len(ptrs))(*ptrs), (ctypes.c_int * len(kinds))(*kinds), max_rows

    @torch.no_grad()
    def fuse_projections(self, quantization: str | None = None) -> "LlamaModel":
        """Prepare for inference: q/k/v and gate/up become one matmul each (fewer calls per
        layer), and every projection and the output layer become a `PackedLinear`, or with
        `quantization="int8"` an `Int8Linear` (quantize.py; the head's logits then stay float32;
        projections below QUANT_MIN_NUMEL stay float); with "int4" the projections an `Int4Linear`
        and the head int8.

        The result keeps its outputs but not Hugging Face parameter names: save unprepared models.
        """
        quantization = check_method(quantization)
        make, head = PackedLinear.of, PackedLinear.of
        if quantization is not None:
            def make(*lins):  # smaller weights stay float: see QUANT_MIN_NUMEL
                big = sum(lin.weight.numel() for lin in lins) >= QUANT_MIN_NUMEL
                if not big:
                    return PackedLinear.of(*lins)
                if all(hasattr(lin, "int8_blocks") for lin in lins):  # a GGUF's Q8_0 blocks, kept (loader.py)
                    return Int8Linear.of(*lins)
                if all(hasattr(lin, "int4_blocks") for lin in lins):  # its Q4 blocks, kept
                    return Int4Linear.of(*lins)
                if quantization == "int4" and lins[0].weight.shape[1] % GROUP == 0:
                    return Int4Linear.of(*lins)
                return Int8Linear.of(*lins)  # (int4: inputs not in whole groups stay int8)

            head = lambda lin: Int8Linear.of(lin, float_out=True)  # noqa: E731
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            a.qkv_proj = make(a.q_proj, a.k_proj, a.v_proj)
            del a.q_proj, a.k_proj, a.v_proj
            a.o_proj = make(a.o_proj)
            m.gate_up_proj = make(m.gate_proj, m.up_proj)
            del m.gate_proj, m.up_proj
            m.down_proj = make(m.down_proj)
        # the head's rows for refine_top_logits (the embeddings when tied: no copy); none for an
        # int8 head, whose logits are float32 already
        self.head_rows = self.lm_head.weight.detach() if quantization is None else None
        tied = self.lm_head.weight is self.model.embed_tokens.weight
        self.lm_head = head(self.lm_head)  # a copy when tied to the embeddings
        if tied and getattr(self.lm_head, "native", None) is not None and self.lm_head.native.dtype == torch.float32:
            # float32 (the only dtype dw_gemm_f32 packs): no refine_top_logits, and the input
            # embedding reads the head's packed copy: one copy of the matrix instead of two
            self.model.embed_tokens, self.head_rows = PackedEmbedding(self.lm_head.native), None
        self.plan = [LayerWeights.of(layer) for layer in self.model.layers]
        self._decoder_plan = self._io = None  # the kernels' pointers: found again on first use
        return self

    def _apply(self, fn, *args, **kwargs):
        if self.plan is not None:  # packed weights are not parameters: they would not follow
            raise RuntimeError("move or cast a model before fuse_projections(), not after")
        return super()._apply(fn, *args, **kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V] float32
        if hidden.dtype == torch.bfloat16 and self.refine_head:
            # a bfloat16 head in dw_gemm_bf16's packing: every logit a float32 sum, not rounded to
            # bfloat16 (what refine_top_logits recomputes for the top ones, for all of them)
            exact = getattr(self.lm_head, "float_logits", None)
            logits = exact(hidden) if exact is not None else None
            if logits is not None:
                return logits
        logits = self.lm_head(hidden).float()
        if hidden.dtype == torch.bfloat16 and self.refine_head and self.head_rows is not None:
            flat = refine_top_logits(logits.view(-1, logits.shape[-1]), hidden.reshape(-1, hidden.shape[-1]),
                                     self.head_rows)
            logits = flat.view(logits.shape)
        return logits

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full causal forward without cache: `[B, T] -> [B, T, vocab]` (training, scoring)."""
        return self.compute_logits(self.forward(input_ids))
