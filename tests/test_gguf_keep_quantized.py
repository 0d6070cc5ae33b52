"""`draftwise import-gguf --keep-quantized`: a GGUF's Q4_0/Q4_1 projections written as draftwise's
int4 blocks and run as they are. The blocks dequantise to the file's own values bitwise (even
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
from draftwise.model.gguf_import import import_gguf, int4_blocks
from draftwise.model.quantize import Int4Linear, Int8Linear, dequantize_int4, quantize_int4
from gguf_files import write_gguf


@pytest.fixture
def every_projection(monkeypatch):
    """The tiny models' projections are below QUANT_MIN_NUMEL: quantize them all."""
    import draftwise.model.llama as llama

    monkeypatch.setattr(llama, "QUANT_MIN_NUMEL", 0)


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
    assert cfg["quantization_config"]["bits"] == 4 and cfg["quantization_config"]["kept_tensors"] == 14
    projections = [k for k in ref if k.endswith("_proj.weight")]
    assert len(projections) == 14
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
    assert torch.equal(attn.qkv_proj.qweight, want_q) and torch.equal(attn.qkv_proj.scale, want_s)
    # the float paths (fuse=False: training, scoring) read the same values as a plain import
    a = load_model(q4, load_tokenizer=False, fuse=False).model.state_dict()
    b = load_model(fl, load_tokenizer=False, fuse=False).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # --quantization int8 re-quantises those values
    m8 = load_model(q4, load_tokenizer=False, quantization="int8").model
    assert isinstance(m8.model.layers[0].self_attn.qkv_proj, Int8Linear)
    assert not any(isinstance(x, Int4Linear) for x in m8.modules())


def test_greedy_tokens_equal_the_float_import_quantised_at_load(kept, every_projection):
    """The gguf package's Q4_1 quantiser spans 0..15 in every block, so re-quantising the float
    import's values at load (`--quantization int4`) gives the same blocks: the same tokens."""
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
    assert "7 Q4 projections kept as int4" in capsys.readouterr().err
    g = tmp_path / "f.gguf"
    write_gguf(g, "llama", "F32", layers=1)
    assert main(["import-gguf", str(g), "--out", str(tmp_path / "f"), "--keep-quantized"]) == 0
    assert "no Q4_0/Q4_1 projections to keep" in capsys.readouterr().err
    assert "quantization_config" not in json.loads((tmp_path / "f" / "config.json").read_text())
