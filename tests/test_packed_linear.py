"""PackedLinear pads products of many rows to a bounded set of row counts (model/llama.py,
EXACT_ROWS): the results must be bitwise those of the unpadded product, and the set of row counts
a server can meet must stay small."""
import pytest
import torch

from draftwise.model.llama import EXACT_ROWS, PackedLinear, padded_rows


def test_padded_rows_bounded_and_tight():
    sizes = {padded_rows(r) for r in range(1, 4097)}
    assert len(sizes) <= 90
    for r in range(1, 4097):
        p = padded_rows(r)
        assert r <= p <= r * 1.125 + 1e-9
        assert padded_rows(p) == p  # a padded size is its own bucket
    assert all(padded_rows(r) == r for r in range(1, EXACT_ROWS + 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_does_not_change_results(dtype):
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
    """On an AVX2-only CPU oneDNN refuses to reorder a bfloat16 weight: the layer must fall back to
    F.linear there (same products) instead of failing at load."""
    from draftwise.model import cpu_kernels
    if native and not cpu_kernels.bf16_native():
        pytest.skip("this CPU has no native bfloat16 products")
    monkeypatch.setattr(cpu_kernels, "bf16_native", lambda: native)
    torch.manual_seed(0)
    w = torch.randn(1024, 256).bfloat16()
    lin = PackedLinear([w])
    assert (lin.packed is not None) == (native and torch.backends.mkldnn.is_available())
    x = torch.randn(3, 256).bfloat16()
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert torch.allclose(lin(x).float(), ref, rtol=2e-2, atol=2e-1)
    f32 = PackedLinear([w.float()])  # float32 is packed on any CPU
    assert (f32.packed is not None) == torch.backends.mkldnn.is_available()
