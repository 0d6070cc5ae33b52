"""PackedLinear pads products of many rows to a bounded set of row counts (model/llama.py,
EXACT_ROWS): the results must be bitwise those of the unpadded product, and the set of row counts
a server can meet must stay small."""
import pytest
import torch

from draftwise.model.packed_weights import EXACT_ROWS, PackedLinear, padded_rows


def test_padded_rows_bounded_and_tight():
    sizes = {padded_rows(r) for r in range(1, 4097)}
    assert len(sizes) <= 90
    for r in range(1, 4097):
        p = padded_rows(r)
        assert r <= p <= r * 1.125 + 1e-9
        assert padded_rows(p) == p  # a padded size is its own bucket
    assert all(padded_rows(r) == r for r in range(1, EXACT_ROWS + 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_does_not_change_results(dtype, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_NATIVE_GEMM", "0")  # oneDNN's products (dw_gemm_f32 never pads)
    torch.manual_seed(0)
    lin = PackedLinear([torch.randn(1024, 256).to(dtype)], [torch.randn(1024).to(dtype)])
    if lin.packed is None:
        pytest.skip("oneDNN packing is not available here")
    for rows in (17, 37, 100, 161):
        assert padded_rows(rows) != rows
        x = torch.randn(2, rows, 256).to(dtype)[1]  # a view, as the model passes
        direct = torch.ops.mkldnn._linear_pointwise(x.contiguous(), lin.packed, lin.bias, "none", [], "")
        out = lin(x)
        assert out.shape == (rows, 1024)
        assert torch.equal(out, direct)


def test_bfloat16_unpacked_products_are_padded_too():
    torch.manual_seed(0)
    lin = PackedLinear([torch.randn(96, 40).bfloat16()])  # small: not packed
    assert lin.packed is None
    seen = []
    real = torch.nn.functional.linear

    def spy(x, w, b=None):
        seen.append(x.shape[0])
        return real(x, w, b)

    torch.nn.functional.linear = spy
    try:
        for rows in (17, 37, 100):
            x = torch.randn(rows, 40).bfloat16()
            assert torch.equal(lin(x), real(x, lin.weight))
    finally:
        torch.nn.functional.linear = real
    assert seen == [padded_rows(r) for r in (17, 37, 100)]


@pytest.mark.parametrize("native", [False, True])
def test_bfloat16_packed_only_where_the_cpu_multiplies_it(monkeypatch, native):
    """On an AVX2-only CPU oneDNN refuses to reorder a bfloat16 weight: the layer must not ask it
    there (dw_gemm_bf16, or F.linear with the kernels off: the same products) instead of failing at
    load. Where the CPU multiplies bfloat16 natively, oneDNN packs it only with the kernels off
    (dw_gemm_bf16 is ~2x faster for decode steps on the AVX-512 EPYC: see `_packable`)."""
    from draftwise.model import cpu_kernels
    from draftwise.model.packed_weights import native_gemm_wanted
    if native and not cpu_kernels.bf16_native():
        pytest.skip("this CPU has no native bfloat16 products")
    monkeypatch.setattr(cpu_kernels, "bf16_native", lambda: native)
    torch.manual_seed(0)
    w = torch.randn(1024, 256).bfloat16()
    lin = PackedLinear([w])
    assert (lin.packed is not None) == (native and torch.backends.mkldnn.is_available() and not native_gemm_wanted())
    assert (lin.native is not None) == native_gemm_wanted()
    x = torch.randn(3, 256).bfloat16()
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert torch.allclose(lin(x).float(), ref, rtol=2e-2, atol=2e-1)
    f32 = PackedLinear([w.float()])  # float32 is packed on any CPU (for dw_gemm_f32 without AVX-512)
    assert f32.is_packed == torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("shape", [(1000, 256, True), (77, 2200, False), (3072, 576, False)])
def test_native_products_equal_onednn_bitwise(shape):
    """Where dw_gemm_f32 replaces oneDNN, every row count gives oneDNN's bits on a CPU without
    AVX-512 (there its kernel is the same FMA chain): outputs not a multiple of 16, inputs past one
    1024-input block, a bias. With AVX-512 oneDNN's wider kernels sum in another order for some
    shapes: dw_gemm_f32 replaces it for every row count, close to its results, and a row's result
    is the same whatever the other rows (verification blocks, batches, single steps agree)."""
    from draftwise.model import cpu_kernels
    from draftwise.model.packed_weights import native_gemm_wanted

    if not native_gemm_wanted() or not torch.backends.mkldnn.is_available():
        pytest.skip("dw_gemm_f32 is not used on this machine")
    O, N, has_bias = shape
    torch.manual_seed(1)
    w, b = torch.randn(O, N), (torch.randn(O) if has_bias else None)
    lin = PackedLinear([w], [b] if has_bias else None)
    assert lin.native is not None and lin.packed is None
    ref = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    same = torch.equal if not cpu_kernels.avx512() else lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    for rows in (1, 2, 3, 5, 6, 7, 13, 48, 49, 100):
        x = torch.randn(rows, N)
        y = lin(x)
        assert same(y, torch.ops.mkldnn._linear_pointwise(x, ref, lin.bias, "none", [], ""))
        assert torch.equal(y[-1:], lin(x[-1:]))  # the last row alone: the same bits
    x = torch.randn(2, 3, N)[1]  # a view of [3, N] rows
    assert same(lin(x), torch.ops.mkldnn._linear_pointwise(x.contiguous(), ref, lin.bias, "none", [], ""))
    cpu_kernels.set_enabled(False)  # switched off after loading: the same product in torch
    try:
        assert torch.allclose(lin(x), torch.ops.mkldnn._linear_pointwise(x.contiguous(), ref, lin.bias, "none", [], ""),
                              rtol=1e-5, atol=1e-4)
    finally:
        cpu_kernels.set_enabled(True)


def test_native_bfloat16_products_match_f_linear():
    """Without native bfloat16 products, large bfloat16 weights run dw_gemm_bf16: float32 sums of
    the widened weights, one rounding at the end, as F.linear's; the same rows alone or together."""
    from draftwise.model.packed_weights import native_gemm_wanted
    from draftwise.model import cpu_kernels

    if not native_gemm_wanted() or cpu_kernels.bf16_native():
        pytest.skip("dw_gemm_bf16 is not used on this machine")
    torch.manual_seed(2)
    w, b = torch.randn(1000, 256).bfloat16(), torch.randn(1000).bfloat16()
    lin = PackedLinear([w], [b])
    assert lin.native is not None and lin.native.dtype == torch.bfloat16 and lin.weight is None
    x = torch.randn(9, 256).bfloat16()
    out = lin(x)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2)
    assert torch.equal(lin(x[3:4]), out[3:4])  # a row's result does not depend on the others


@pytest.mark.parametrize("shape", [(37, 2049), (1000, 256), (200, 3)])
def test_bfloat16_packed_products_any_shape(shape):
    """dw_gemm_bf16_f32out (the bfloat16 products of every packed bfloat16 weight; VDPBF16PS pairs
    where the CPU has AVX-512 BF16, widened FMA chains elsewhere): float32 sums of the bfloat16
    operands for an odd number of inputs (the last one alone), inputs past one 1024-input block,
    outputs not a multiple of 16; a row's sums bitwise the same alone, in any batch, on 1 or 2
    threads."""
    from draftwise.model import cpu_kernels

    k = cpu_kernels.kernels()
    if k is None:
        pytest.skip("no kernels on this machine")
    O, N = shape
    g = torch.Generator().manual_seed(O + N)
    w = torch.randn(O, N, generator=g).bfloat16()
    wp = torch.empty((O + 15) // 16, N, 16, dtype=torch.bfloat16)
    k.pack(w.data_ptr(), wp.data_ptr(), O, N, 2)

    def product(x, threads=2):
        out = torch.empty(x.shape[0], O)
        k.gemm_bf16_f32out(x.data_ptr(), wp.data_ptr(), 0, out.data_ptr(), x.shape[0], O, N, threads)
        return out

    x = torch.randn(13, N, generator=g).bfloat16()
    exact = (x.double() @ w.double().t()).float()
    full = product(x)
    scale = x.double().abs() @ w.double().abs().t()  # the sums' magnitude: float32 rounding bounds
    assert ((full.double() - exact.double()).abs() <= 1e-5 * scale + 1e-30).all()
    for rows in (1, 2, 5, 6, 7):
        part = x[-rows:].contiguous()
        assert torch.equal(product(part), full[-rows:])
        assert torch.equal(product(part, threads=1), full[-rows:])
