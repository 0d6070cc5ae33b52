"""GGUF K-quant and Q5_0 blocks -> draftwise's int4 / int8-group layouts (model/gguf_blocks.py):
Q5_0 and Q8_0 exactly, Q4_K to float16 rounding of its sub-block steps, Q6_K within a fraction of
its own step; a loaded directory holding such blocks runs them without a float copy."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from draftwise.model.gguf_blocks import blocks_of, dequantized, q4k_blocks, q5_0_blocks
from draftwise.model.quantize import dequantize_int4, dequantize_q8_groups, int8_groups


def _reader_tensor(kind_name: str, raw: np.ndarray, rows: int, cols: int):
    import gguf

    return SimpleNamespace(data=raw, shape=np.array([cols, rows]), tensor_type=gguf.GGMLQuantizationType[kind_name],
                           name="t")


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape[:-1], -1)


def _q4k(rows: int, cols: int, seed: int):
    """Random Q4_K super-blocks (144 bytes: d, dmin, 12 scale bytes, 128 bytes of nibbles)."""
    rng = np.random.default_rng(seed)
    nb = rows * cols // 256
    d = _fp16_bytes(rng.uniform(1e-4, 3e-3, (nb, 1)))
    dmin = _fp16_bytes(rng.uniform(1e-4, 3e-3, (nb, 1)))
    rest = rng.integers(0, 256, (nb, 140), dtype=np.uint8)
    return _reader_tensor("Q4_K", np.concatenate([d, dmin, rest], axis=1).reshape(rows, -1), rows, cols)


def _q6k(rows: int, cols: int, seed: int):
    """Random Q6_K super-blocks (210 bytes: 128 low bits, 64 high bits, 16 int8 scales, d)."""
    rng = np.random.default_rng(seed)
    nb = rows * cols // 256
    rest = rng.integers(0, 256, (nb, 208), dtype=np.uint8)
    d = _fp16_bytes(rng.uniform(1e-4, 1e-3, (nb, 1)))
    return _reader_tensor("Q6_K", np.concatenate([rest, d], axis=1).reshape(rows, -1), rows, cols)


def test_q4k_keeps_its_4bit_values_and_rounds_only_the_steps():
    t = _q4k(8, 512, seed=0)
    q, sm = q4k_blocks(t)
    assert q.shape == (8, 256) and q.dtype == torch.uint8 and sm.shape == (8, 16, 2) and sm.dtype == torch.float16
    ref = torch.from_numpy(dequantized(t))
    ours = dequantize_int4(q, sm)
    step = sm[..., 0].float().repeat_interleave(32, dim=1)  # [8, 512] each value's step
    err = (ours - ref).abs()
    # float16 steps and minima: a relative 2^-11 of the values' size, far below a step
    assert torch.all(err <= 16 * step * 2.0 ** -10 + ref.abs() * 2.0 ** -10)
    assert (err > 0).any()  # (the rounding exists: an exact comparison would not test it)
    # the 4-bit values themselves are the file's: 32-byte chunk c of a super-block's 128 holds
    # sub-block 2c in its low nibbles and 2c + 1 in its high ones
    chunks = torch.from_numpy(np.ascontiguousarray(t.data).reshape(8, -1, 144)[..., 16:].reshape(8, -1, 4, 32))
    want = torch.stack([chunks & 15, chunks >> 4], dim=3).reshape(8, 512)
    b = q.reshape(8, -1, 16)
    assert torch.equal(torch.cat([b & 15, b >> 4], dim=-1).reshape(8, 512), want)


def test_q5_0_is_exact_as_int8_groups():
    import gguf

    w = (np.random.default_rng(1).standard_normal((6, 128)) * 0.1).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0)
    t = _reader_tensor("Q5_0", raw, 6, 128)
    q, d = q5_0_blocks(t)
    assert q.dtype == torch.int8 and q.shape == (6, 128) and d.shape == (6, 4)
    assert int(q.min()) >= -16 and int(q.max()) <= 15
    assert torch.equal(dequantize_q8_groups(q, d), torch.from_numpy(dequantized(t)))


def test_q6k_becomes_int8_groups_within_a_fraction_of_its_step():
    t = _q6k(4, 256, seed=2)
    kind, q, d = blocks_of(t)
    assert kind == "int8" and q.shape == (4, 256) and d.shape == (4, 8)
    ref = torch.from_numpy(dequantized(t))
    err = (dequantize_q8_groups(q, d) - ref).abs().reshape(4, 8, 32)
    assert torch.all(err <= d.float()[..., None] * 0.5 + 1e-6)  # half an int8 step of the group
    assert err.max() > 0


@pytest.mark.parametrize("kind_name,layout", [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q8_0", "int8"), ("Q5_0", "int8"),
                                              ("F32", None)])
def test_layout_by_type(kind_name, layout):
    import gguf

    w = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind_name])
    got = blocks_of(_reader_tensor(kind_name, raw, 4, 64))
    assert (got[0] if got else None) == layout


def test_int8_groups_round_trip_is_near():
    w = torch.randn(3, 64)
    q, d = int8_groups(w)
    assert (dequantize_q8_groups(q, d) - w).abs().max() <= d.float().max() * 0.51
    q0, d0 = int8_groups(torch.zeros(2, 32))
    assert torch.equal(q0, torch.zeros(2, 32, dtype=torch.int8))
