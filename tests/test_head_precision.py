"""bfloat16 LM heads: the top logits recomputed in float32 (model/head_precision.py)."""
import pytest
import torch
import torch.nn.functional as F

from draftwise.model import load_model
from draftwise.model.head_precision import refine_top_logits


def test_a_rounding_tie_is_broken_by_the_float32_product():
    # 16.03125 and 16.0625 both round to 16.0 in bfloat16 (step 0.125 there): a tie, broken by index
    w = torch.tensor([[16.0, 0.03125], [16.0, 0.0625], [1.0, 0.0]], dtype=torch.bfloat16)  # [V=3, H=2]
    h = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)  # [N=1, H]
    logits = F.linear(h, w).float()
    assert logits[0, 0] == logits[0, 1] == 16.0 and logits.argmax(-1).item() == 0
    out = refine_top_logits(logits.clone(), h, w, top=2)
    assert out[0, :2].tolist() == [16.03125, 16.0625] and out.argmax(-1).item() == 1
    assert out[0, 2] == 1.0  # below the top 2: untouched
    assert refine_top_logits(logits.clone(), h, w, top=0).equal(logits)


def test_refined_entries_are_the_float32_products_row_by_row():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2000, 576, generator=g).bfloat16()  # [V, H]
    h = torch.randn(40, 576, generator=g).bfloat16()  # [N, H]
    logits = F.linear(h, w).float()
    out = refine_top_logits(logits.clone(), h, w, top=8)
    exact = h.float() @ w.float().t()  # [N, V]
    top = logits.topk(8, dim=-1).indices
    assert torch.allclose(out.gather(-1, top), exact.gather(-1, top), rtol=1e-6, atol=1e-6)
    changed = (out != logits).sum(-1)
    assert (changed <= 8).all() and changed.sum() > 0
    alone = torch.cat([refine_top_logits(logits[i:i + 1].clone(), h[i:i + 1], w) for i in range(40)])
    assert alone.equal(out)  # a row's logits do not depend on the other rows


def test_a_bfloat16_model_refines_and_a_float32_one_does_not(target_dir):
    m16 = load_model(target_dir, dtype="bfloat16", load_tokenizer=False).model
    m32 = load_model(target_dir, dtype="float32", load_tokenizer=False).model
    h = torch.randn(3, 2, m16.cfg.hidden_size, generator=torch.Generator().manual_seed(1))  # [B, T, H]
    on = m16.compute_logits(h.bfloat16())
    m16.refine_head = False
    off = m16.compute_logits(h.bfloat16())
    assert on.shape == off.shape == (3, 2, m16.cfg.vocab_size) and on.dtype == torch.float32
    assert not on.equal(off)
    exact = h.bfloat16().float() @ m16.head_rows.float().t()
    top = off.topk(8, dim=-1).indices
    assert torch.allclose(on.gather(-1, top), exact.gather(-1, top), rtol=1e-5, atol=1e-5)
    assert m32.compute_logits(h).equal(m32.lm_head(h).float())


def test_a_packed_bfloat16_head_gives_every_logit_in_float32():
    """A bfloat16 head in dw_gemm_bf16's packing gives float32 sums for the whole vocabulary (no
    bfloat16 rounding, so no refinement needed), a row's logits independent of the other rows."""
    from draftwise.model import cpu_kernels
    from draftwise.model.packed_weights import NATIVE_MIN_NUMEL, PackedLinear

    g = torch.Generator().manual_seed(2)
    V, H = 4096, max(96, -(-NATIVE_MIN_NUMEL // 4096))
    lin = torch.nn.Linear(H, V, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(V, H, generator=g))
    head = PackedLinear.of(lin)
    if cpu_kernels.kernels() is None or head.native is None:
        pytest.skip("no dw_gemm_bf16 packing on this machine (AVX-512 BF16, or the kernels off)")
    h = torch.randn(5, H, generator=g).bfloat16()
    logits = head.float_logits(h)
    exact = h.float() @ lin.weight.float().t()
    assert logits.dtype == torch.float32
    assert torch.allclose(logits, exact, rtol=1e-5, atol=1e-4)
    assert not logits.equal(head(h).float())  # the bfloat16 product's outputs are rounded
    assert torch.cat([head.float_logits(h[i:i + 1]) for i in range(5)]).equal(logits)
