"""Bad input gets one clear error that names what was wrong."""
import json
import shutil
import subprocess
import sys

import pytest

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.model import ModelLoadError


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="model directory not found"):
        LLM(str(tmp_path / "nope"))


def test_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tmp_path, target_dir):
    d = tmp_path / "m"
    shutil.copytree(target_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="architectures.*GPT2LMHeadModel"):
        LLM(str(d))


def test_shape_mismatch(tmp_path, target_dir):
    d = tmp_path / "m"
    shutil.copytree(target_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] += 1
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="model.safetensors.*mlp.*shape"):
        LLM(str(d))


def test_missing_tokenizer(tmp_path, target_dir):
    d = tmp_path / "m"
    shutil.copytree(target_dir, d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        LLM(str(d))


def test_vocab_mismatch(tmp_path, target_dir):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from tiny_models import make_model_dir

    d = make_model_dir(tmp_path / "d", vocab_size=500, layers=1, hidden=32, heads=2, kv_heads=1, inter=64)
    with pytest.raises(ValueError, match="draft vocabulary size \\(500"):
        LLM(str(target_dir), draft=str(d), spec=SpecConfig(method="draft"))


@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_values(kwargs, param):
    with pytest.raises(ValueError, match=param):
        SamplingParams(**kwargs)


def test_unknown_token_ids(target_dir):
    llm = LLM(str(target_dir))
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("x", SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[10**6]], SamplingParams())


def test_prompt_longer_than_context(target_dir):
    llm = LLM(str(target_dir))
    with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
        llm.generate([[5] * 300], SamplingParams(max_tokens=4))


def test_cli_errors_are_one_line(tmp_path, target_dir):
    cases = [
        ["generate", "x", "--model", str(tmp_path / "nope")],
        ["generate", "x", "--model", str(target_dir), "--temperature", "-1"],
        ["generate", "x", "--model", str(target_dir), "--method", "bogus"],
    ]
    for argv in cases:
        r = subprocess.run([sys.executable, "-m", "draftwise.cli.main", *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in r.stderr
