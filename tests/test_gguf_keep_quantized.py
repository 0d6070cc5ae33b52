"""`draftwise import-gguf --keep-quantized`: a GGUF's Q4_0/Q4_1 projections written as draftwise's
int4 blocks, its Q8_0 ones as int8 with a scale per group of 32 (`dw_gemm_q8g`), run as they are. The blocks dequantise to the file's own values bitwise (even
blocks that re-quantising their floats would change), the Q/K permutation is undone on them, the
loaded model's Int4Linear holds them unchanged, the float paths read the same values as a plain
import, and a broken directory gives a clear error."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from draftwise import LLM, SamplingParams
from draftwise.cli.main import main
from draftwise.model import ModelLoadError, load_model
from draftwise.model import cpu_kernels
from draftwise.model.gguf_import import import_gguf, int4_blocks, q8_blocks
from draftwise.model.quantize import Int4Linear, Int8Linear, dequantize_int4, dequantize_q8_groups, quantize_int4
from gguf_files import write_gguf

needs_kernels = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: kernels unavailable")


@pytest.fixture
def every_projection(monkeypatch):
    """The tiny models' projections are below QUANT_MIN_NUMEL: quantize them all."""
    import draftwise.model.llama as llama

    monkeypatch.setattr(llama, "QUANT_MIN_NUMEL", 0)


@pytest.fixture(params=["float", "int8"])
def activations(request, monkeypatch):
    """Kept blocks run with float activations, or int8 ones where the kernels have VNNI (act8.py)."""
    if request.param == "int8" and not cpu_kernels.vnni():
        pytest.skip("kernels without AVX-512 VNNI: float activations only")
    monkeypatch.setenv("DRAFTWISE_ACT8", "1" if request.param == "int8" else "0")
    return request.param


def _tensor(qtype: str, w: np.ndarray):
    """A reader-like tensor (data, GGUF dims, type) holding `w` [out, in] quantised by the gguf package."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    return SimpleNamespace(data=gguf.quants.quantize(w, kind), shape=np.array(w.shape[::-1]), tensor_type=kind,
                           name="t")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_blocks_dequantise_to_the_files_values(qtype):
    import gguf

    w = (np.random.default_rng(0).standard_normal((24, 96)) * 0.2).astype(np.float32)
    t = _tensor(qtype, w)
    q, sm = int4_blocks(t)
    assert q.dtype == torch.uint8 and q.shape == (24, 48) and sm.dtype == torch.float16 and sm.shape == (24, 3, 2)
    ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(24, 96)
    assert torch.equal(dequantize_int4(q, sm), torch.from_numpy(np.ascontiguousarray(ref)))


def test_blocks_kept_where_requantising_would_change_them():
    """Blocks whose 4-bit values do not span 0..15 (an importance-weighted quantiser's choice):
    re-quantising their floats picks another step; kept, they are the file's values."""
    import gguf

    rng = np.random.default_rng(1)
    rows, groups = 8, 2
    d = (rng.uniform(0.01, 0.02, (rows, groups, 1))).astype(np.float16)
    m = (rng.uniform(-0.2, -0.1, (rows, groups, 1))).astype(np.float16)
    vals = rng.integers(3, 11, (rows, groups, 32)).astype(np.uint8)  # 3..10 only
    qs = vals[..., :16] | (vals[..., 16:] << 4)
    raw = np.concatenate([d.view(np.uint8), m.view(np.uint8), qs], axis=-1).reshape(rows, -1)
    t = SimpleNamespace(data=raw, shape=np.array([groups * 32, rows]), tensor_type=gguf.GGMLQuantizationType.Q4_1)
    q, sm = int4_blocks(t)
    want = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, t.tensor_type).reshape(rows, -1)))
    assert torch.equal(dequantize_int4(q, sm), want)
    assert not torch.equal(dequantize_int4(*quantize_int4(want)), want)  # what re-quantising would have given


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """{arch: (float import, kept import)} for Q4_1 files, permuted (mistral) and not (qwen2)."""
    root = tmp_path_factory.mktemp("kept")
    out = {}
    for i, arch in enumerate(["mistral", "qwen2"]):
        f = root / f"{arch}.gguf"
        write_gguf(f, arch, "Q4_1", seed=10 + i)
        out[arch] = (import_gguf(f, root / f"{arch}-float"), import_gguf(f, root / f"{arch}-q4", keep_quantized=True))
    return out


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_directory_holds_the_blocks(kept, arch):
    fl, q4 = kept[arch]
    ours, ref = load_file(str(q4 / "model.safetensors")), load_file(str(fl / "model.safetensors"))
    cfg = json.loads((q4 / "config.json").read_text())
    assert cfg["quantization_config"]["int4_tensors"] == 14 and cfg["quantization_config"]["int8_tensors"] == 0
    projections = [k for k in ref if k.endswith("_proj.weight")]
    assert len(projections) == 14
    top = [k for k in ("model.embed_tokens.weight", "lm_head.weight") if k in ref]
    assert top
    projections += top  # the embeddings and head are written as blocks too, never as floats
    for k in projections:  # Q/K unpermuted on the blocks: they dequantise to the float import's rows
        stem = k[: -len(".weight")]
        assert k not in ours
        assert torch.equal(dequantize_int4(ours[f"{stem}.qweight"], ours[f"{stem}.qscale"]), ref[k]), k
    for k in set(ref) - set(projections):
        assert torch.equal(ours[k], ref[k]), k


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_loaded_model_runs_the_blocks(kept, arch, every_projection):
    fl, q4 = kept[arch]
    stored = load_file(str(q4 / "model.safetensors"))
    m = load_model(q4, load_tokenizer=False).model
    attn = m.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, Int4Linear) and isinstance(m.model.layers[1].mlp.down_proj, Int4Linear)
    p = "model.layers.0.self_attn"
    want_q = torch.cat([stored[f"{p}.{n}_proj.qweight"] for n in "qkv"])
    want_s = torch.cat([stored[f"{p}.{n}_proj.qscale"] for n in "qkv"])
    assert torch.equal(attn.qkv_proj.blocks()[0], want_q) and torch.equal(attn.qkv_proj.blocks()[1], want_s)
    # the float paths (fuse=False: training, scoring) read the same values as a plain import
    a = load_model(q4, load_tokenizer=False, fuse=False).model.state_dict()
    b = load_model(fl, load_tokenizer=False, fuse=False).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # --quantization int8 re-quantises those values
    m8 = load_model(q4, load_tokenizer=False, quantization="int8").model
    assert isinstance(m8.model.layers[0].self_attn.qkv_proj, Int8Linear)
    assert not any(isinstance(x, Int4Linear) for x in m8.modules())


def test_greedy_tokens_equal_the_float_import_quantised_at_load(kept, every_projection, monkeypatch):
    """The gguf package's Q4_1 quantiser spans 0..15 in every block, so re-quantising the float
    import's values at load (`--quantization int4`) gives the same blocks: the same tokens (with
    float activations for both: int8 ones are for kept blocks only)."""
    monkeypatch.setenv("DRAFTWISE_ACT8", "0")
    fl, q4 = kept["qwen2"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = [5, 17, 40, 99, 123]
    a = LLM(q4, dtype="float32").generate([prompt], params)[0].token_ids
    b = LLM(fl, dtype="float32", quantization="int4").generate([prompt], params)[0].token_ids
    assert a == b and len(a) == 24


def test_broken_directory_is_a_clear_error(kept, tmp_path):
    import shutil

    _, q4 = kept["qwen2"]
    d = tmp_path / "broken"
    shutil.copytree(q4, d)
    sd = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.qscale"
    del sd[name]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=f"tensor '{name}' missing"):
        load_model(d, load_tokenizer=False)
    sd[name] = torch.zeros(3, 2, 2, dtype=torch.float16)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="do not hold a"):
        load_model(d, load_tokenizer=False)


def test_cli_flag(tmp_path, capsys):
    f = tmp_path / "m.gguf"
    write_gguf(f, "llama", "Q4_1", layers=1)
    assert main(["import-gguf", str(f), "--out", str(tmp_path / "q4"), "--keep-quantized"]) == 0
    assert "projections kept: 7 as int4, 0 as int8 groups" in capsys.readouterr().err
    g = tmp_path / "f.gguf"
    write_gguf(g, "llama", "F32", layers=1)
    assert main(["import-gguf", str(g), "--out", str(tmp_path / "f"), "--keep-quantized"]) == 0
    assert "no quantized projections to keep" in capsys.readouterr().err
    assert "quantization_config" not in json.loads((tmp_path / "f" / "config.json").read_text())


# ---- Q8_0: int8 in groups of 32 with a float16 scale each (dw_gemm_q8g) ----

def test_q8_blocks_dequantise_to_the_files_values():
    import gguf

    w = (np.random.default_rng(3).standard_normal((20, 64)) * 0.3).astype(np.float32)
    t = _tensor("Q8_0", w)
    q, d = q8_blocks(t)
    assert q.dtype == torch.int8 and q.shape == (20, 64) and d.dtype == torch.float16 and d.shape == (20, 2)
    ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(20, 64)
    assert torch.equal(dequantize_q8_groups(q, d), torch.from_numpy(np.ascontiguousarray(ref)))


def _q8_layer(o: int, n: int, bias: bool = False, seed: int = 0):
    """(an Int8Linear built from random Q8_0-style blocks, its q, its d)"""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (o, n), generator=g, dtype=torch.int8)
    d = (torch.rand(o, n // 32, generator=g) * 0.01 + 1e-3).half()
    lin = torch.nn.Linear(n, o, bias=bias)
    lin.int8_blocks = (q, d)
    if bias:
        with torch.no_grad():
            lin.bias.copy_(torch.randn(o, generator=g))
    return Int8Linear.of(lin), q, d


@needs_kernels
@pytest.mark.parametrize("o,n", [(48, 64), (37, 96), (200, 576)])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_group_kernel_matches_reference(o, n, rows, dtype, activations):
    from draftwise.model import act8

    layer, q, d = _q8_layer(o, n, bias=True)
    assert layer.group == 32 and layer.act8 == (activations == "int8")
    assert torch.equal(layer.qweight, q)
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows)).to(dtype)
    product = act8.q8_reference if layer.act8 else torch.nn.functional.linear
    ref = product(x.float(), dequantize_q8_groups(q, d), layer.bias)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (rows, o)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # (another summation order: relative to the outputs' scale)
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * float(ref.abs().max()))
    assert torch.equal(layer.dequantized(), dequantize_q8_groups(q, d))


@needs_kernels
@pytest.mark.parametrize("o", [200, 1536])  # (1536 x 576 splits across threads)
def test_q8_group_rows_independent_and_threads_do_not_matter(o):
    from test_quantize_int4 import rows_and_threads_independent

    layer, _, _ = _q8_layer(o, 576, seed=1)
    assert rows_and_threads_independent(layer, torch.randn(7, 576))


@pytest.fixture(scope="module")
def kept_q8(tmp_path_factory):
    """(float import, kept import) of a llama Q8_0 file (Q/K permuted)."""
    root = tmp_path_factory.mktemp("kept8")
    f = root / "llama.gguf"
    write_gguf(f, "llama", "Q8_0", seed=20)
    return import_gguf(f, root / "float"), import_gguf(f, root / "q8", keep_quantized=True)


def test_q8_directory_and_model(kept_q8, every_projection):
    fl, q8 = kept_q8
    ours, ref = load_file(str(q8 / "model.safetensors")), load_file(str(fl / "model.safetensors"))
    qc = json.loads((q8 / "config.json").read_text())["quantization_config"]
    assert (qc["int8_tensors"], qc["int4_tensors"]) == (14, 0)
    for k in [k for k in ref if k.endswith("_proj.weight")]:
        stem = k[: -len(".weight")]
        assert ours[f"{stem}.qweight"].dtype == torch.int8
        assert torch.equal(dequantize_q8_groups(ours[f"{stem}.qweight"], ours[f"{stem}.qscale"]), ref[k]), k
    m = load_model(q8, load_tokenizer=False).model
    qkv = m.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int8Linear) and qkv.group == 32
    p = "model.layers.0.self_attn"
    assert torch.equal(qkv.qweight, torch.cat([ours[f"{p}.{n}_proj.qweight"] for n in "qkv"]))
    a = load_model(q8, load_tokenizer=False, fuse=False).model.state_dict()
    b = load_model(fl, load_tokenizer=False, fuse=False).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    m4 = load_model(q8, load_tokenizer=False, quantization="int4").model  # asked: re-quantised
    assert isinstance(m4.model.layers[0].self_attn.qkv_proj, Int4Linear)


def test_q8_one_call_step_equals_layer_by_layer_bitwise(kept_q8, every_projection, monkeypatch, activations):
    from test_cpu_kernels import load_with_distinct_norms, run_batch_rounds, run_rounds

    from draftwise.model import cpu_kernels
    from draftwise.model.llama import LlamaModel

    _, q8 = kept_q8
    one = load_with_distinct_norms(q8, "float32")
    a = run_rounds(one, []) + run_batch_rounds(load_with_distinct_norms(q8, "float32"))
    if not one.model._decoder_plan:
        pytest.skip("this CPU's products are oneDNN's: the per-layer path only")
    assert set(one.model._decoder_plan[1]) == {6 if activations == "int8" else 5}
    monkeypatch.setattr(LlamaModel, "_layer_pointers", lambda self: ())
    b = run_rounds(load_with_distinct_norms(q8, "float32"), []) + run_batch_rounds(load_with_distinct_norms(q8, "float32"))
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_q8_greedy_speculative_equals_plain(kept_q8, every_projection, activations):
    from draftwise import SpecConfig

    _, q8 = kept_q8
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ps = [[5, 17, 40, 99, 123, 5, 17, 40], [7, 8, 9, 7, 8, 9, 7]]
    base = LLM(q8).generate(ps, sp)
    spec = LLM(q8, draft=str(q8), spec=SpecConfig(method="draft", k=4)).generate(ps, sp)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    assert sum(o.stats.accepted_tokens for o in spec) == sum(o.stats.proposed_tokens for o in spec) > 0


def test_stored_quantization_reported(kept, kept_q8, tmp_path):
    """What a directory runs by default: bench's results record it instead of `--quantization none`."""
    from draftwise.cli.bench import _quantization
    from draftwise.model.loader import stored_quantization

    fl, q4 = kept["qwen2"]
    _, q8 = kept_q8
    assert (stored_quantization(q4), stored_quantization(q8), stored_quantization(fl)) == ("int4", "int8", None)
    args = SimpleNamespace(quantization="none", url=None, model=str(q4))
    assert _quantization(args) == "int4"
    assert _quantization(SimpleNamespace(quantization="int8", url=None, model=str(q4))) == "int8"
    assert _quantization(SimpleNamespace(quantization="none", url=None, model=str(fl))) == "none"


@pytest.mark.parametrize("which", ["q4", "q8"])
def test_kept_embedding_and_head_run_in_the_whole_step_bitwise(kept, kept_q8, which, every_projection, monkeypatch):
    """A kept model's block embedding (int4 or int8 groups, dequantised row by row) and its int8
    head with int8 activations run inside dw_forward (`native_logits`): the logits equal bitwise
    those of PyTorch's lookup, the decoder call and compute_logits."""
    from test_cpu_kernels import load_with_distinct_norms, native_logits_calls, run_batch_rounds, run_rounds

    from draftwise.model.llama import LlamaModel
    from draftwise.model.packed_weights import QuantizedEmbedding

    if not cpu_kernels.vnni():
        pytest.skip("kernels without AVX-512 VNNI: the head is not an int8-activation product")
    path = (kept["qwen2"] if which == "q4" else kept_q8)[1]
    one = load_with_distinct_norms(path, "float32")
    emb, head = one.model.model.embed_tokens, one.model.lm_head
    assert isinstance(emb, QuantizedEmbedding) and emb.kind == ("int4" if which == "q4" else "int8")
    assert isinstance(head, Int8Linear) and head.act8 and head.float_out
    assert one.model._native_io() is not None
    taken = native_logits_calls(monkeypatch)
    a = run_rounds(one, []) + run_batch_rounds(load_with_distinct_norms(path, "float32"))
    assert taken and all(taken)
    monkeypatch.setattr(LlamaModel, "native_logits", lambda self, *a, **kw: None)
    b = run_rounds(load_with_distinct_norms(path, "float32"), []) + run_batch_rounds(load_with_distinct_norms(path, "float32"))
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
