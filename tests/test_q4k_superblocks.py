"""Q4_K super-blocks with integer sub-scales (act8.py, kernels/vnni.c's dw_linear_q4k_a8): the import
keeps the file's sub-scales exactly, the layout round-trips, the kernel equals the PyTorch statement
of its arithmetic, rows are independent of the block and the threads, and a model imported from a
Q4_K file decodes speculatively as it does plainly, in one call per step as layer by layer."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.model import ModelLoadError, act8, cpu_kernels, load_model
from draftwise.model.gguf_blocks import dequantized, q4k_blocks, q4k_subscales
from draftwise.model.quantize import Int4Linear, dequantize_int4
from test_gguf_blocks import _q4k
from test_quantize_int4 import rows_and_threads_independent

needs_vnni = pytest.mark.skipif(not cpu_kernels.vnni(), reason="kernels without AVX-512 VNNI")


def _exact(sub: torch.Tensor, sup: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """float32 [O, N]: d * sc * q - dmin * mn, as the gguf package dequantises Q4_K."""
    o = q.shape[0]
    b = q.reshape(o, -1, 16)
    vals = torch.cat([b & 15, b >> 4], dim=-1).float()  # [O, G, 32]
    ds = sup.float().repeat_interleave(8, dim=1)  # [O, G, 2]
    sf = sub.float()
    return ((ds[..., 0] * sf[..., 0])[..., None] * vals - (ds[..., 1] * sf[..., 1])[..., None]).reshape(o, -1)


def _layer(o: int, n: int, seed: int = 0, bias: bool = True) -> tuple[Int4Linear, tuple]:
    t = _q4k(o, n, seed=seed)
    q, sm = q4k_blocks(t)
    sub, sup = q4k_subscales(t)
    b = [torch.randn(o, generator=torch.Generator().manual_seed(seed))] if bias else None
    return Int4Linear([], b, blocks=[(q, sm)], subscales=[(sub, sup)]), (q, sub, sup, t)


def test_subscales_are_the_files_values():
    t = _q4k(8, 512, seed=0)
    q, sm = q4k_blocks(t)
    sub, sup = q4k_subscales(t)
    assert sub.dtype == torch.uint8 and sub.shape == (8, 16, 2) and int(sub.max()) <= 63
    assert sup.dtype == torch.float16 and sup.shape == (8, 2, 2)
    assert torch.equal(_exact(sub, sup, q), torch.from_numpy(dequantized(t)))  # bitwise the file's values
    assert torch.equal(act8.q4k_steps(sub, sup), sm)  # the int4 groups' steps and minima derive from them


def test_layout_round_trips():
    t = _q4k(37, 768, seed=1)  # (outputs not a multiple of 16: padded)
    q, _ = q4k_blocks(t)
    sub, sup = q4k_subscales(t)
    qv, ks = act8.pack_q4k(q, sub, sup)
    assert ks.shape == (3, 3, 320) and ks.dtype == torch.uint8
    for a, b in zip(act8.unpack_q4k(qv, ks, 37), (q, sub, sup)):
        assert torch.equal(a, b)


@needs_vnni
@pytest.mark.parametrize("o,n", [(40, 256), (200, 768)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference(o, n, rows, dtype):
    layer, (q, sub, sup, _) = _layer(o, n)
    assert layer.super_blocks and layer.kernel[0] == 8
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows)) * 3
    x[:, 5::97] *= 30  # outliers: the other sub-blocks of their super-blocks on finer power-of-two steps
    x = x.to(dtype)
    e = act8.super_block_rows(x.float())[1]
    assert {1.0, 8.0} <= set(e.unique().tolist())
    ref = act8.q4k_reference(x, q, sub, sup, layer.bias)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (rows, o)
    if dtype == torch.float32:  # the same operations in the same order: equal up to a rare double rounding
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))
        assert (out == ref).float().mean() > 0.99
    else:
        torch.testing.assert_close(out.float(), ref.to(dtype).float(), rtol=8e-3, atol=0)


@needs_vnni
def test_the_integer_sums_do_not_overflow_at_the_extremes():
    """Every nibble 15, every sub-scale 63, activations at +-max on the finest sub-step (e = 8): the
    halves' sums reach 16 * 15 * 127 (the int16 bound VPDPWSSD reads them in), the scaled sums
    8 * 32 * 127, the super-block's 8 * 63 * 8 * 32 * 15 * 127."""
    o, n = 16, 512
    q = torch.full((o, n // 2), 0xFF, dtype=torch.uint8)
    sub = torch.full((o, n // 32, 2), 63, dtype=torch.uint8)
    sup = torch.full((o, n // 256, 2), 1e-3, dtype=torch.float16)
    layer = Int4Linear([], None, blocks=[(q, act8.q4k_steps(sub, sup))], subscales=[(sub, sup)])
    big = torch.full((2, n), 0.5)
    big[:, ::256] = 4.0  # one input a super-block 8x the rest: its other sub-blocks on steps 8x finer
    for x in (torch.full((2, n), 5.0), torch.full((2, n), -5.0), big, -big):
        out, ref = layer(x), act8.q4k_reference(x, q, sub, sup, None)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(out, x @ _exact(sub, sup, q).t(), rtol=1e-2, atol=0)  # (an overflow: far off)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_independent_and_threads_do_not_matter(dtype):
    layer, _ = _layer(1536, 512, seed=2)  # (large enough for the OpenMP split)
    assert rows_and_threads_independent(layer, torch.randn(7, 512).to(dtype))


@needs_vnni
def test_close_to_float_activations():
    layer, (q, sub, sup, _) = _layer(256, 1024, seed=3, bias=False)
    x = torch.randn(5, 1024)
    x[:, 7::64] *= 20  # outliers
    ref = x @ _exact(sub, sup, q).t()
    rel = float((layer(x) - ref).norm() / ref.norm())
    assert 0 < rel < 0.02  # the activations' rounding, not a broken product
    xq, e, xs = act8.super_block_rows(x)
    coarse = xs * 8 * torch.round(x.reshape(xq.shape) / (xs * 8)[..., None]).flatten(-2)  # one step per 256
    fine = (xq * e[..., None] * xs[..., None]).reshape(5, -1)
    assert float((fine - x).norm()) < 0.75 * float((coarse.reshape(5, -1) - x).norm())  # the sub-steps pay


def test_switch_and_shapes_keep_the_groups(monkeypatch):
    """DRAFTWISE_Q4K=0, or inputs not in whole super-blocks: the int4 groups of 32 as before."""
    t = _q4k(32, 512, seed=4)
    q, sm = q4k_blocks(t)
    monkeypatch.setenv("DRAFTWISE_Q4K", "0")
    assert not Int4Linear([], None, blocks=[(q, sm)], subscales=[q4k_subscales(t)]).super_blocks
    monkeypatch.delenv("DRAFTWISE_Q4K")
    assert not act8.super_blocks_wanted(384)
    layer = Int4Linear([], None, blocks=[(q, sm)], subscales=[q4k_subscales(t)])
    assert layer.super_blocks == cpu_kernels.vnni()
    bq, bsm = layer.blocks()
    assert torch.equal(bq, q) and torch.equal(bsm, sm)
    assert torch.equal(dequantize_int4(bq, bsm), dequantize_int4(q, sm))


def test_directory_holds_the_subscales(q4k_model):
    sd = load_file(str(q4k_model / "model.safetensors"))
    p = "model.layers.0.mlp.down_proj"
    assert sd[f"{p}.qsub"].shape == (256, 16, 2) and sd[f"{p}.qsuper"].shape == (256, 2, 2)
    assert f"{p}.qscale" not in sd  # (the groups' steps and minima follow from the sub-scales)


def test_broken_subscales_are_a_clear_error(q4k_model, tmp_path):
    sd = load_file(str(q4k_model / "model.safetensors"))
    del sd["model.layers.1.self_attn.o_proj.qsuper"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in q4k_model.iterdir():
        if f.name != "model.safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="o_proj.qsub"):
        load_model(bad)
    assert json.loads((bad / "config.json").read_text())["quantization_config"]["int4_tensors"] > 0


@needs_vnni
def test_model_speculative_equals_plain_and_one_call_equals_layer_by_layer(q4k_model, monkeypatch):
    import draftwise.model.llama as llama

    monkeypatch.setattr(llama, "QUANT_MIN_NUMEL", 0)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ps = [[5, 17, 40, 99, 123, 5, 17, 40], [7, 8, 9, 7, 8, 9, 7]]
    plain = LLM(q4k_model)
    mods = [m for m in plain.engine.runner.model.modules() if isinstance(m, Int4Linear)]
    assert mods and all(m.super_blocks for m in mods)
    base = plain.generate(ps, sp)
    for draft_dtype in ("float32", None):  # (None: the CPU's default bfloat16 draft)
        spec = LLM(q4k_model, draft=str(q4k_model), spec=SpecConfig(method="draft", k=4),
                   draft_dtype=draft_dtype).generate(ps, sp)
        assert [o.token_ids for o in spec] == [o.token_ids for o in base]
        if draft_dtype:  # the model drafting for itself: every proposal its verification's own token
            assert sum(o.stats.accepted_tokens for o in spec) == sum(o.stats.proposed_tokens for o in spec) > 0
    monkeypatch.setenv("DRAFTWISE_NATIVE_STEP", "0")
    layered = LLM(q4k_model).generate(ps, sp)
    assert [o.token_ids for o in layered] == [o.token_ids for o in base]


def test_float_paths_read_the_files_values(q4k_model):
    """fuse=False (training's path) dequantises the kept blocks: the file's Q4_K values to float16
    rounding of the sub-block steps (the int4 groups' form)."""
    m = load_model(q4k_model, fuse=False, load_tokenizer=False).model
    w = m.model.layers[0].mlp.down_proj.weight
    sd = load_file(str(q4k_model / "model.safetensors"))
    p = "model.layers.0.mlp.down_proj"
    assert torch.equal(w, dequantize_int4(sd[f"{p}.qweight"], act8.q4k_steps(sd[f"{p}.qsub"], sd[f"{p}.qsuper"])))
    exact = _exact(sd[f"{p}.qsub"], sd[f"{p}.qsuper"], sd[f"{p}.qweight"])
    assert float((w - exact).abs().max()) <= float(exact.abs().max()) * 2.0 ** -9
    assert np.isfinite(w.numpy()).all()
