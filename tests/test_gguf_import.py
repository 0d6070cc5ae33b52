"""`draftwise import-gguf`: tiny random GGUF files (written here with `gguf.GGUFWriter`) imported and
checked against transformers' own GGUF loading of the same file: the weights exactly, greedy tokens
over 32 steps through draftwise's `LLM`, and the tokenizer on a few strings. The real SmolLM2
file in a slow test (`pytest -m slow`), skipped when `make smollm2` has not fetched it."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from draftwise import LLM, SamplingParams
from draftwise.cli.main import main
from draftwise.model.gguf_import import GGUFImportError, import_gguf, unpermute
from gguf_files import CHATML, _permute, write_gguf, write_spm_gguf

CASES = [("llama", "F32"), ("llama", "Q8_0"), ("qwen2", "Q4_1"), ("mistral", "Q4_1"), ("qwen3", "Q8_0")]
STRINGS = ["Hello world", "def parse_args(argv):\n    return argv[1:]", "<|im_start|>user\nhi<|im_end|>\n",
           "12345 naïve 日本 ", "  two  spaces\n\n\ttab", "The quick brown fox's jumps"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{(arch, qtype): (gguf file, imported dir, original HF weights)}"""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for i, (arch, qt) in enumerate(CASES):
        f = root / f"{arch}-{qt}.gguf"
        sd = write_gguf(f, arch, qt, seed=i, tie=arch == "qwen3")
        out[arch, qt] = (f, import_gguf(f, root / f"{arch}-{qt}"), sd)
    return out


def hf_gguf_model(f: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(str(f.parent), gguf_file=f.name, dtype=torch.float32).eval()


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(8 * 3, 5)
    for heads in (1, 2, 3):
        assert torch.equal(unpermute(torch.from_numpy(_permute(w, heads)), heads), torch.from_numpy(w))
    b = np.arange(24, dtype=np.float32)
    assert torch.equal(unpermute(torch.from_numpy(_permute(b, 3)), 3), torch.from_numpy(b))


@pytest.mark.parametrize("case", [("llama", "F32"), ("llama", "Q8_0"), ("qwen2", "Q4_1")])
def test_weights_equal_transformers(imported, case):
    f, d, _ = imported[case]
    ours = load_file(str(d / "model.safetensors"))
    ref = hf_gguf_model(f).state_dict()
    assert set(ours) == set(ref)
    for k in ours:
        assert torch.equal(ours[k], ref[k]), k


def test_f32_weights_are_the_originals(imported):
    """F32 round trip: the file's permuted Q/K rows come back in Hugging Face order."""
    _, d, sd = imported["llama", "F32"]
    ours = load_file(str(d / "model.safetensors"))
    for k, v in sd.items():
        assert torch.equal(ours[k], torch.from_numpy(v)), k


@pytest.mark.parametrize("case", CASES[1:])
def test_quantised_weights_close_to_originals(imported, case):
    """Mistral (permuted) and Qwen3 (head_dim from key_length, q/k norms, tied) are not loaded by
    transformers' GGUF path here: they are checked against the weights the file was made from."""
    _, d, sd = imported[case]
    ours = load_file(str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["tie_word_embeddings"] == (case[0] == "qwen3")
    assert set(ours) == set(sd) - ({"lm_head.weight"} if cfg["tie_word_embeddings"] else set())
    tol = {"Q8_0": 0.01, "Q4_1": 0.12}[case[1]]
    for k in ours:
        assert (ours[k] - torch.from_numpy(sd[k])).abs().max() <= tol, k


@pytest.mark.parametrize("case", [("llama", "Q8_0"), ("qwen2", "Q4_1")])
def test_greedy_tokens_match_transformers(imported, case):
    f, d, _ = imported[case]
    prompt = [5, 17, 40, 99, 123]
    out = LLM(d, dtype="float32").generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    model = hf_gguf_model(f)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == ref


@pytest.mark.parametrize("case", [("llama", "F32"), ("qwen2", "Q4_1"), ("mistral", "Q4_1")])
def test_tokenizer_matches_transformers(imported, case):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    f, d, _ = imported[case]
    ours = Tokenizer.from_file(str(d / "tokenizer.json"))
    ref = AutoTokenizer.from_pretrained(str(f.parent), gguf_file=f.name)
    for s in STRINGS:
        ids = ours.encode(s).ids
        assert ids == ref(s)["input_ids"], s
        assert ours.decode(ids, skip_special_tokens=False) == s
    assert ours.encode("<|im_end|>").ids == [2]  # control tokens stay whole


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    """Llama 2 / Mistral v0.1 style: merges rebuilt from the scores, byte fallback, BOS added."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    write_spm_gguf(tmp_path / "spm.gguf")
    ours = Tokenizer.from_file(str(import_gguf(tmp_path / "spm.gguf", tmp_path / "spm") / "tokenizer.json"))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for s in ["hello world", " the  quick fox", "Speculative decoding!", "héllo\nworld 12"]:
        ids = ours.encode(s).ids
        assert ids == ref(s)["input_ids"] and ids[0] == 1, s
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_pre_tokenizer_table(tmp_path):
    """`smollm` splits digits one by one before the GPT-2 pattern (llama.cpp's STARCODER group);
    `llama-bpe` keeps up to three digits together."""
    from tokenizers import Tokenizer

    pieces = {}
    for pre in ("smollm", "llama-bpe", "gpt2"):
        write_gguf(tmp_path / f"{pre}.gguf", "llama", "F32", pre=pre, layers=1)
        tok = Tokenizer.from_file(str(import_gguf(tmp_path / f"{pre}.gguf", tmp_path / pre) / "tokenizer.json"))
        pieces[pre] = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("x 12345 y")]
    assert pieces["smollm"] == ["x", "Ġ", "1", "2", "3", "4", "5", "Ġy"]
    assert pieces["llama-bpe"] == ["x", "Ġ", "123", "45", "Ġy"]
    assert pieces["gpt2"] == ["x", "Ġ12345", "Ġy"]


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    """llama.cpp stores Llama 3.1's rope scaling as per-frequency divisors (`rope_freqs`); the
    import recovers the `llama3` parameters, so draftwise's frequencies are the file's."""
    import math

    from draftwise.model import ModelConfig
    from draftwise.model.llama import rope_inv_freq

    d, factor, old = 16, 8.0, 8192
    freqs = 1.0 / 10000.0 ** (np.arange(0, d, 2) / d)
    divisors = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        smooth = min(1.0, max(0.0, (old / wavelen - 1.0) / 3.0))
        divisors.append(1.0 if wavelen < old / 4 else factor if wavelen > old else 1 / ((1 - smooth) / factor + smooth))
    write_gguf(tmp_path / "l3.gguf", "llama", "F32", layers=1,
               extra={"rope_freqs.weight": np.array(divisors, np.float32)})
    cfg = json.loads((import_gguf(tmp_path / "l3.gguf", tmp_path / "l3") / "config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    inv = rope_inv_freq(ModelConfig.from_dict(cfg)).double()
    assert torch.allclose(inv, torch.from_numpy(freqs / np.array(divisors, np.float32)), rtol=1e-5)
    assert 1.0 < min(x for x in divisors if x > 1.0) < max(divisors)  # some frequencies interpolated


def test_configs_written(imported):
    _, d, _ = imported["qwen2", "Q4_1"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["attention_bias"] is True
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == CHATML
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == [2]


def test_bfloat16_import(imported, tmp_path):
    f, d32, _ = imported["llama", "Q8_0"]
    d = import_gguf(f, tmp_path / "bf16", dtype="bfloat16")
    w, w32 = load_file(str(d / "model.safetensors")), load_file(str(d32 / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    assert torch.equal(w["model.layers.0.self_attn.q_proj.weight"], w32["model.layers.0.self_attn.q_proj.weight"].bfloat16())


def _cli_error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


def test_cli_errors(capsys, tmp_path):
    assert "file not found" in _cli_error(capsys, "import-gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "o"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    assert "not a readable GGUF file" in _cli_error(capsys, "import-gguf", str(junk), "--out", str(tmp_path / "o"))
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    err = _cli_error(capsys, "import-gguf", str(tmp_path / "phi.gguf"), "--out", str(tmp_path / "o"))
    assert "general.architecture 'phi3' is not supported" in err
    assert not (tmp_path / "o").exists()


def test_out_must_be_a_model_directory_to_be_replaced(imported, tmp_path):
    f, d, _ = imported["llama", "F32"]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(GGUFImportError, match="exists and is not a model directory"):
        import_gguf(f, other)
    assert (other / "keep.txt").read_text() == "mine"
    again = import_gguf(f, tmp_path / "m")
    (again / "stale.bin").write_text("x")
    assert not (import_gguf(f, again) / "stale.bin").exists()  # a model directory is replaced whole


def test_unsupported_tensor_type(tmp_path, monkeypatch):
    import gguf

    f = tmp_path / "m.gguf"
    write_gguf(f, "llama", "Q8_0", layers=1)

    def refuse(data, qtype):
        raise NotImplementedError

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    with pytest.raises(GGUFImportError, match="has type F32, which the gguf package cannot dequantise|has type Q8_0"):
        import_gguf(f, tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [f]


SMOLLM2 = Path(os.environ.get("DRAFTWISE_CACHE", Path.home() / ".cache" / "draftwise")) / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2.is_file(), reason="SmolLM2 GGUF absent (make smollm2 fetches it)")
def test_smollm2_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    d = import_gguf(SMOLLM2, tmp_path / "smollm2")
    llm = LLM(d, dtype="float32")
    model = hf_gguf_model(SMOLLM2)
    hf_tok = AutoTokenizer.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name)
    for q in ["What is the capital of France?", "Write a Python function that reverses a string."]:
        text = hf_tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        ids = hf_tok(text, add_special_tokens=False)["input_ids"]
        assert llm.tokenizer.encode(text).ids == ids
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                                 eos_token_id=None, pad_token_id=2)[0, len(ids):].tolist()
        assert out.token_ids == ref, q
