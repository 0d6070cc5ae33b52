"""int8 activations for kept GGUF blocks (model/act8.py, kernels/vnni.c): the kernels equal the
PyTorch statement of the same arithmetic, rows are independent of the block and the threads
(verification equals decoding bitwise), the layouts round-trip, and a kept int4 model decodes
speculatively as it does plainly."""
from __future__ import annotations

import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.model import act8, cpu_kernels
from draftwise.model.quantize import Int4Linear, Int8Linear, int8_groups, quantize_int4
from test_quantize_int4 import rows_and_threads_independent

needs_vnni = pytest.mark.skipif(not cpu_kernels.vnni(), reason="kernels without AVX-512 VNNI")


def _layers(o: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(o, n, generator=g) * 0.05
    b = torch.randn(o, generator=g)
    return (Int8Linear([], [b], blocks=[int8_groups(w)]), Int4Linear([], [b], blocks=[quantize_int4(w)]), w)


def test_quantized_rows_round_to_the_groups_steps():
    x = torch.tensor([[1.0] * 31 + [-127.0], [0.0] * 32])
    assert torch.equal(act8.quantized_rows(x), x)  # on the grid already; an all-zero group stays zero
    y = torch.randn(3, 64)
    err = (act8.quantized_rows(y) - y).abs().reshape(3, 2, 32)
    step = y.abs().reshape(3, 2, 32).amax(-1, keepdim=True) / 127
    assert (err <= step / 2 + 1e-7).all() and err.max() > 0


def test_layouts_round_trip():
    q8, _ = int8_groups(torch.randn(37, 96))
    assert torch.equal(act8.unpack_q8(act8.pack_q8(q8), 37), q8)
    q4, sm = quantize_int4(torch.randn(37, 96))
    q, s = act8.unpack_q4(*act8.pack_q4(q4, sm), 37)
    assert torch.equal(q, q4) and torch.equal(s, sm)


@needs_vnni
@pytest.mark.parametrize("o,n", [(40, 64), (200, 576), (1536, 320)])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_the_reference(o, n, rows, dtype):
    l8, l4, _ = _layers(o, n)
    assert l8.act8 and l4.act8
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows)).to(dtype)
    for layer, ref in ((l8, act8.q8_reference(x, l8.dequantized(), l8.bias)),
                       (l4, act8.q4_reference(x, *l4.blocks(), l4.bias))):
        out = layer(x)
        assert out.dtype == dtype and out.shape == (rows, o)
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # (float sums in another order; bfloat16 outputs)
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


@needs_vnni
def test_prefill_rows_run_in_the_kernel_too():
    """Past KERNEL_MAX_ROWS (a prefill chunk) the same kernel: bitwise the rows of a smaller block."""
    l8, l4, _ = _layers(64, 96)
    x = torch.randn(40, 96)
    for layer, ref in ((l8, act8.q8_reference(x, l8.dequantized(), l8.bias)),
                       (l4, act8.q4_reference(x, *l4.blocks(), l4.bias))):
        out = layer(x)
        assert torch.equal(out[:16], layer(x[:16]))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_independent_and_threads_do_not_matter(dtype):
    l8, l4, _ = _layers(1536, 320, seed=1)  # (large enough for the OpenMP split)
    x = torch.randn(7, 320).to(dtype)
    assert rows_and_threads_independent(l8, x) and rows_and_threads_independent(l4, x)


@needs_vnni
def test_close_to_float_activations():
    l8, l4, w = _layers(256, 512)
    x = torch.randn(5, 512)
    for layer, deq in ((l8, l8.dequantized()), (l4, None)):
        ref = torch.nn.functional.linear(x, deq if deq is not None else _deq4(l4), layer.bias)
        rel = float((layer(x) - ref).norm() / ref.norm())
        assert 0 < rel < 0.02  # the activations' rounding, not a broken product


def _deq4(layer):
    from draftwise.model.quantize import dequantize_int4

    return dequantize_int4(*layer.blocks())


@needs_vnni
def test_kept_int4_model_speculative_equals_plain(tmp_path, monkeypatch):
    import draftwise.model.llama as llama
    from draftwise.model.gguf_import import import_gguf
    from gguf_files import write_gguf

    monkeypatch.setattr(llama, "QUANT_MIN_NUMEL", 0)
    f = tmp_path / "m.gguf"
    write_gguf(f, "qwen2", "Q4_1", seed=3)
    q4 = import_gguf(f, tmp_path / "q4", keep_quantized=True)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ps = [[5, 17, 40, 99, 123, 5, 17, 40], [7, 8, 9, 7, 8, 9, 7]]
    plain = LLM(q4)
    assert any(getattr(m, "act8", False) for m in plain.engine.runner.model.modules())
    base = plain.generate(ps, sp)
    spec = LLM(q4, draft=str(q4), spec=SpecConfig(method="draft", k=4)).generate(ps, sp)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    assert sum(o.stats.accepted_tokens for o in spec) == sum(o.stats.proposed_tokens for o in spec) > 0
