"""Weight-only int4 quantization (model/quantize.py: groups of 32, a float16 step and minimum each):
the layout, the kernel against the dequantised reference, row independence, the one-call step,
and greedy speculative == greedy plain in int4."""
import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.model import cpu_kernels, load_model
from draftwise.model.quantize import GROUP, Int4Linear, Int8Linear, dequantize_int4, quantize_int4

from test_greedy_equality import prompts
from test_quantize import check_speculative_against_plain, quantized_and_error

needs_kernels = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: kernels unavailable")


@pytest.fixture(autouse=True, scope="module")
def quantize_every_projection():
    """The tiny test models' projections are below QUANT_MIN_NUMEL: quantize them all anyway."""
    import draftwise.model.llama as llama

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama, "QUANT_MIN_NUMEL", 0)
        yield


def _layer(o: int, n: int, bias: bool = False, seed: int = 0) -> Int4Linear:
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(n, o, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(o, n, generator=g) * 0.1)
        if bias:
            lin.bias.copy_(torch.randn(o, generator=g))
    return Int4Linear.of(lin)


def test_quantize_int4_groups_and_nibbles():
    w = torch.randn(5, 64)
    q, sm = quantize_int4(w)
    assert q.dtype == torch.uint8 and q.shape == (5, 32) and sm.dtype == torch.float16 and sm.shape == (5, 2, 2)
    # byte i of a group: q[i] low, q[i + 16] high; w = d * q + m
    d, m = sm[0, 0, 0].float(), sm[0, 0, 1].float()
    vals = torch.round((w[0, :32] - m) / d).clamp(0, 15)
    assert int(q[0, 3]) == int(vals[3]) | (int(vals[19]) << 4)
    err = (dequantize_int4(q, sm) - w).abs().reshape(5, 2, GROUP)
    step = sm[..., 0].float()
    assert (err <= step[..., None] / 2 + 1e-3 * step[..., None] + 1e-6).all()  # half a step (+ float16 rounding)
    with pytest.raises(ValueError, match="groups of 32"):
        quantize_int4(torch.randn(4, 48))
    z = quantize_int4(torch.zeros(2, 32))  # a constant group: step 0, every weight exact
    assert torch.equal(dequantize_int4(*z), torch.zeros(2, 32))


@needs_kernels
@pytest.mark.parametrize("o,n", [(37, 64), (96, 128), (200, 96)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_kernel_matches_reference(o, n, rows, dtype):
    layer = _layer(o, n, bias=True)
    x = torch.randn(rows, n).to(dtype)
    ref = torch.nn.functional.linear(x.float(), dequantize_int4(layer.qweight, layer.scale), layer.bias)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (rows, o)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def rows_and_threads_independent(layer, x: torch.Tensor) -> bool:
    """A kernel layer's rows: bitwise the same one by one as in a block, on 1 or 2 threads."""
    block = layer(x)
    if not torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(len(x))]), block):
        return False
    n = torch.get_num_threads()
    try:
        return all(torch.set_num_threads(t) or torch.equal(layer(x), block) for t in (2, 1))
    finally:
        torch.set_num_threads(n)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_rows_independent_and_threads_do_not_matter(dtype):
    assert rows_and_threads_independent(_layer(200, 96, seed=1), torch.randn(7, 96).to(dtype))


def test_int4_model_close_to_float(target_dir):
    """int4 projections and an int8 head (its logits float32), close to the float model's logits
    (quantization error, not a broken product; the one-call step against the per-layer path:
    test_cpu_kernels' test_one_call_step_equals_layer_by_layer_bitwise[int4])."""
    q, rel = quantized_and_error(target_dir, "int4")
    assert isinstance(q.model.layers[0].self_attn.qkv_proj, Int4Linear)
    assert isinstance(q.model.layers[0].mlp.down_proj, Int4Linear)
    assert isinstance(q.lm_head, Int8Linear) and q.head_rows is None
    assert 0 < rel < 0.2, rel


@pytest.mark.parametrize("method,draft", [("draft", "draft"), ("draft", "target"), ("ngram", None)])
def test_greedy_speculative_equals_plain_int4(target_dir, draft_dir, method, draft):
    llm = LLM(str(target_dir), quantization="int4")
    ps = prompts(llm.engine.vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = llm.generate(ps, sp)
    d = {"target": target_dir, "draft": draft_dir, None: None}[draft]
    # the drafter in the target's dtype: by default it is bfloat16 on a CPU with native bfloat16
    spec = LLM(str(target_dir), draft=str(d) if d else None, spec=SpecConfig(method=method, k=4), quantization="int4",
               draft_dtype="float32" if draft == "target" else None)
    outs = spec.generate(ps, sp)
    # (the same int4 model drafting for itself, in float32: every proposal accepted)
    check_speculative_against_plain(target_dir, "int4", ps, outs, base, draft == "target")
