"""Weight-only int8 quantization (model/quantize.py): the kernel against the dequantised
reference, row independence, loading, errors, and greedy speculative == greedy plain in int8."""
import subprocess
import sys

import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.model import cpu_kernels, load_model
from draftwise.model.config import ModelLoadError
from draftwise.model.quantize import Int8Linear, dequantize_int8, int8_linear_reference, quantize_int8

from test_greedy_equality import near_tie_divergences, prompts

@pytest.fixture(autouse=True, scope="module")
def quantize_every_projection():
    """The tiny test models' projections are below QUANT_MIN_NUMEL: quantize them all anyway."""
    import draftwise.model.llama as llama

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama, "QUANT_MIN_NUMEL", 0)
        yield


needs_kernels = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: kernels unavailable")


def test_quantize_int8_per_channel():
    torch.manual_seed(0)
    w = torch.randn(37, 53) * torch.linspace(0.01, 5, 37)[:, None]  # very different row ranges
    w[3] = 0.0  # an all-zero channel
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (37,) and s.dtype == torch.float32
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert (q[3] == 0).all()
    nonzero = torch.arange(37) != 3
    assert (q[nonzero].abs().amax(1) == 127).all()  # each channel uses its full range
    err = (dequantize_int8(q, s) - w).abs()
    assert (err <= s[:, None] / 2 + 1e-6).all()  # rounding to the nearest step


def _layer(O, N, bias, float_out=False, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(N, O, bias=bias)
    return Int8Linear.of(lin, float_out=float_out)


SHAPES = [(37, 53), (64, 64), (130, 200), (5, 16), (300, 384)]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("O,N", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 5, 16])
def test_kernel_matches_reference(O, N, rows, dtype):
    for bias, float_out in ((False, False), (True, False), (True, True)):
        layer = _layer(O, N, bias, float_out)
        x = torch.randn(rows, N).to(dtype)
        got = layer(x)
        out_dtype = torch.float32 if float_out else dtype
        assert got.dtype == out_dtype and got.shape == (rows, O)
        ref = int8_linear_reference(x, layer.qweight, layer.scale, layer.bias, torch.float32)
        if out_dtype == torch.float32:  # float32 sums in another order
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * N ** 0.5)
        else:  # at most one bfloat16 step apart (the float32 sums round either side)
            step = ref.abs().clamp_min(1e-3) * 2.0 ** -7
            assert ((got.float() - ref).abs() <= step).all()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rows_are_independent(dtype):
    """A row's result is bitwise the same alone or in a block of 5 (verification vs decoding)."""
    for O, N in SHAPES:
        layer = _layer(O, N, bias=True)
        x = torch.randn(5, N).to(dtype)
        block = layer(x)
        for r in range(5):
            assert torch.equal(layer(x[r:r + 1]), block[r:r + 1]), (O, N, r)
        assert torch.equal(layer(x[1:4]), block[1:4])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_threads_do_not_change_results(dtype):
    """A weight large enough for the OpenMP split (Q8_MIN_PARALLEL) gives bitwise the same outputs on
    1 and 2 threads: each thread owns whole outputs."""
    layer = _layer(301, 512, bias=True)  # 154K elements, 301 = 75 blocks of 4 + 1
    x = torch.randn(7, 512).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        two = layer(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernels
def test_many_rows_take_the_reference_path():
    layer = _layer(64, 48, bias=True)
    x = torch.randn(40, 48)
    ref = int8_linear_reference(x, layer.qweight, layer.scale, layer.bias, torch.float32)
    assert torch.equal(layer(x), ref)
    torch.testing.assert_close(layer(x[:16]), ref[:16], rtol=1e-5, atol=1e-5)  # the kernel's rows


def quantized_and_error(target_dir, method: str):
    """(the model loaded with `method`, the relative error of its float32 logits against the float
    model's on one prompt)."""
    f = load_model(target_dir, load_tokenizer=False).model
    q = load_model(target_dir, load_tokenizer=False, quantization=method).model
    ids = torch.tensor([prompts(f.cfg.vocab_size, 1)[0] + [5, 6, 7]])
    with torch.no_grad():
        lf, lq = f.logits(ids), q.logits(ids)
    assert lq.dtype == torch.float32
    return q, float((lf - lq).norm() / lf.norm())


def check_speculative_against_plain(target_dir, method: str, ps, outs, base, self_draft: bool) -> None:
    """Greedy speculative outputs equal plain ones (near-ties aside); a model drafting for itself
    has every proposal accepted."""
    target = load_model(target_dir, load_tokenizer=False, quantization=method).model
    assert near_tie_divergences(target, ps, outs, base) <= 1
    proposed = sum(o.stats.proposed_tokens for o in outs)
    accepted = sum(o.stats.accepted_tokens for o in outs)
    assert proposed > 0
    if self_draft:
        assert accepted == proposed


def test_quantized_model_close_to_float(target_dir):
    """int8 logits stay close to the float model's (quantization error, not a broken product)."""
    q, rel = quantized_and_error(target_dir, "int8")
    assert isinstance(q.lm_head, Int8Linear) and q.head_rows is None
    assert isinstance(q.model.layers[0].self_attn.qkv_proj, Int8Linear)
    assert 0 < rel < 0.05, rel


def test_small_projections_stay_float(target_dir, monkeypatch):
    import draftwise.model.llama as llama

    monkeypatch.setattr(llama, "QUANT_MIN_NUMEL", 64 * 64 + 1)  # the 64x64 o_proj stays float
    m = load_model(target_dir, load_tokenizer=False, quantization="int8").model
    a = m.model.layers[0].self_attn
    assert isinstance(a.qkv_proj, Int8Linear) and not isinstance(a.o_proj, Int8Linear)
    assert isinstance(m.lm_head, Int8Linear)


def test_bad_quantization_is_a_clear_error(target_dir):
    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4; got 'int3'"):
        LLM(str(target_dir), quantization="int3")
    r = subprocess.run([sys.executable, "-m", "draftwise.cli.main", "generate", "--model", str(target_dir),
                        "--quantization", "int3", "hi"], capture_output=True, text=True)
    assert r.returncode == 2 and "--quantization" in r.stderr and "Traceback" not in r.stderr


def test_hybrid_model_refused(tmp_path):
    from tiny_hybrid import make_hybrid_dir

    d = make_hybrid_dir(tmp_path / "hybrid")
    with pytest.raises(ModelLoadError, match="quantization 'int8' supports Llama-family models"):
        load_model(d, quantization="int8")


@pytest.fixture(scope="module")
def plain_int8(target_dir):
    llm = LLM(str(target_dir), quantization="int8")
    ps = prompts(llm.engine.vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return ps, sp, llm.generate(ps, sp)


@pytest.mark.parametrize("method,draft,dtype", [("draft", "draft", "float32"), ("draft", "target", "float32"),
                                                ("ngram", None, "float32"), ("draft", "draft", "bfloat16")])
def test_greedy_speculative_equals_plain_int8(plain_int8, target_dir, draft_dir, method, draft, dtype):
    ps, sp, base = plain_int8
    if dtype == "bfloat16":  # the plain baseline in the same dtype
        base = LLM(str(target_dir), quantization="int8", dtype=dtype).generate(ps, sp)
    d = {"target": target_dir, "draft": draft_dir, None: None}[draft]
    llm = LLM(str(target_dir), draft=str(d) if d else None, spec=SpecConfig(method=method, k=4), dtype=dtype,
              draft_dtype=dtype if draft == "target" else None, quantization="int8")
    if d is not None:
        assert isinstance(llm.engine.proposer.runner.model.lm_head, Int8Linear)
    outs = llm.generate(ps, sp)
    # (the same int8 model drafting for itself in float32: every proposal accepted)
    check_speculative_against_plain(target_dir, "int8", ps, outs, base, draft == "target" and dtype == "float32")
