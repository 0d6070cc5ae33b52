"""A GGUF tensor's quantized blocks -> draftwise's own layouts (quantize.py), without a float copy
of the model: one tensor at a time.

Two layouts hold every block type:

- int4 (`q [O, N/2] uint8`, `sm [O, N/32, 2] float16`: a step d and a minimum m per 32 inputs,
  w = d * q + m, q in 0..15) for Q4_0, Q4_1 and Q4_K. Q4_K's super-blocks of 256 are 8 sub-blocks
  of 32, each w = (d * sc) * q - (dmin * mn) with 4-bit q: exactly Q4_1's form, so its 4-bit values
  are kept and only the sub-block's step and minimum are rounded to float16 (a relative 2^-11).
- int8 in groups (`q [O, N] int8`, `d [O, N/32] float16`, w = d * q, run by `dw_gemm_q8g`) for
  Q8_0 and Q5_0 (w = d * (q - 16): q - 16 in -16..15 is an int8 value, so both exactly), and for
  every other type (Q6_K, Q5_K, Q2_K, Q3_K, IQ*) from its dequantised values: d = max|w| / 127 per
  group of 32, a finer grid than the 5- or 6-bit one it came from.

`blocks_of(t)` picks the layout by type: ("int4", q, sm) or ("int8", q, d). A Q4_K tensor's integer
sub-scales are kept beside its int4 groups too (`q4k_subscales`): the VNNI kernels run them as
super-blocks (act8.py).
"""
from __future__ import annotations

import numpy as np
import torch

from .quantize import GROUP, int8_groups

QK_K = 256  # inputs per K-quant super-block


def _rows(t) -> int:
    return int(t.shape[1]) if len(t.shape) > 1 else 1


def _raw(t, block_bytes: int) -> np.ndarray:
    """The tensor's bytes as [rows, blocks per row, block_bytes]."""
    rows = _rows(t)
    return np.ascontiguousarray(t.data, dtype=np.uint8).reshape(rows, -1, block_bytes)


def dequantized(t) -> np.ndarray:
    """float32 [O, N] of a reader tensor (the gguf package's dequantisation)."""
    import gguf

    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(arr, dtype=np.float32).reshape(_rows(t), -1)


def int4_blocks(t) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_0 or Q4_1 reader tensor -> draftwise's int4 (q [O, N/2] uint8, sm [O, N/32, 2] float16),
    the blocks' own values: per block of 32 inputs Q4_1 holds d, m (float16) and 16 bytes whose low
    nibbles are inputs 0..15 and high nibbles 16..31 (Q4_0: d and the bytes, m = -8d)."""
    import gguf

    size = 20 if t.tensor_type == gguf.GGMLQuantizationType.Q4_1 else 18
    blocks = _raw(t, size)
    rows = blocks.shape[0]
    d = blocks[..., 0:2].copy().view(np.float16)  # [O, G, 1]
    if size == 20:
        m, qs = blocks[..., 2:4].copy().view(np.float16), blocks[..., 4:]
    else:
        m, qs = (d.astype(np.float32) * -8).astype(np.float16), blocks[..., 2:]
    q = torch.from_numpy(np.ascontiguousarray(qs).reshape(rows, -1))
    sm = torch.from_numpy(np.concatenate([d, m], axis=-1))
    return q.contiguous(), sm.contiguous()


def q4k_subscales(t) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_K reader tensor's integer sub-scales as stored: (sub [O, N/32, 2] uint8: each sub-block's
    6-bit scale sc and minimum mn; sup [O, N/256, 2] float16: each super-block's d and dmin), so that
    w = d * sc * q - dmin * mn exactly (the form `dw_linear_q4k_a8` runs, act8.py)."""
    from gguf.quants import Q4_K

    blocks = _raw(t, 144)
    rows, nb = blocks.shape[:2]
    flat = blocks.reshape(-1, 144)
    sc, mn = Q4_K.get_scale_min(flat[:, 4:16].copy())  # [B, 8] each
    sub = np.stack([sc, mn], axis=-1).astype(np.uint8).reshape(rows, nb * 8, 2)
    sup = flat[:, 0:4].copy().view(np.float16).reshape(rows, nb, 2)
    return torch.from_numpy(sub).contiguous(), torch.from_numpy(sup).contiguous()


def q4k_blocks(t) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_K reader tensor -> int4 (q [O, N/2], sm [O, N/32, 2]). A super-block of 144 bytes: d,
    dmin (float16), 12 bytes of 6-bit sub-block scales and minima, 128 bytes of 4-bit values whose
    32-byte chunk c holds sub-block 2c in its low nibbles and 2c + 1 in its high ones."""
    from gguf.quants import Q4_K

    blocks = _raw(t, 144)
    rows, nb = blocks.shape[:2]
    flat = blocks.reshape(-1, 144)
    d = flat[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = flat[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(flat[:, 4:16].copy())  # [B, 8] each
    step = (d * sc.astype(np.float32)).astype(np.float16)  # [B, 8]
    low = (-(dmin * mn.astype(np.float32))).astype(np.float16)
    chunks = flat[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    vals = (chunks & 15).reshape(-1, 8, 32)  # [B, 8 sub-blocks, 32]
    packed = vals[..., :16] | (vals[..., 16:] << 4)  # draftwise's nibble order: i and i + 16 share a byte
    q = torch.from_numpy(np.ascontiguousarray(packed).reshape(rows, nb * 8 * 16))
    sm = torch.from_numpy(np.stack([step, low], axis=-1).reshape(rows, nb * 8, 2))
    return q.contiguous(), sm.contiguous()


def q8_blocks(t) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 reader tensor -> (q [O, N] int8, d [O, N/32] float16), the blocks' own values: per
    block of 32 inputs a float16 scale d and 32 int8 values, w = d * q."""
    blocks = _raw(t, 34)
    rows = blocks.shape[0]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # [O, G]
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return torch.from_numpy(q).contiguous(), torch.from_numpy(d).contiguous()


def q5_0_blocks(t) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q5_0 reader tensor -> int8 in groups (q [O, N] int8, d [O, N/32] float16), exactly: a block
    of 22 bytes is d (float16) and 32 5-bit values, w = d * (q - 16); d * (q - 16) is exact in
    float32, so dividing the dequantised values by d recovers q - 16."""
    d = _raw(t, 22)[..., 0:2].copy().view(np.float16)[..., 0]  # [O, G]
    w = dequantized(t).reshape(*d.shape, GROUP)
    df = d.astype(np.float32)[..., None]
    q = np.where(df != 0, np.rint(w / np.where(df != 0, df, 1)), 0).astype(np.int8)
    return torch.from_numpy(q.reshape(d.shape[0], -1)).contiguous(), torch.from_numpy(d).contiguous()


def blocks_of(t) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """("int4", q, sm) or ("int8", q, d) for a quantized reader tensor whose rows are whole groups of
    32; None for float types (F32, F16, BF16) and shapes the layouts cannot hold."""
    import gguf

    T = gguf.GGMLQuantizationType
    kind = t.tensor_type
    if kind in (T.F32, T.F16, T.BF16) or len(t.shape) != 2 or int(t.shape[0]) % GROUP:
        return None
    if kind in (T.Q4_0, T.Q4_1):
        return ("int4", *int4_blocks(t))
    if kind == T.Q4_K:
        return ("int4", *q4k_blocks(t))
    if kind == T.Q8_0:
        return ("int8", *q8_blocks(t))
    if kind == T.Q5_0:
        return ("int8", *q5_0_blocks(t))
    return ("int8", *int8_groups(dequantized(t)))


__all__ = ["blocks_of", "dequantized", "int4_blocks", "q4k_blocks", "q4k_subscales", "q5_0_blocks", "q8_blocks"]
