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


def test_vocab_mismatch(tmp_path, target_dir, capsys):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from tiny_models import make_model_dir

    d = make_model_dir(tmp_path / "d", vocab_size=500, layers=1, hidden=32, heads=2, kv_heads=1, inter=64)
    LLM(str(target_dir), draft=str(d), spec=SpecConfig(method="draft"))  # mapped through the tokenizers
    assert "drafting across vocabularies" in capsys.readouterr().err
    (d / "tokenizer.json").unlink()  # nothing to map the ids with
    with pytest.raises(ValueError, match="needs both tokenizers .*tokenizer.json is missing"):
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


# ------------------------------------------------------------------------ the command line's user errors
def run_cli(argv, capsys) -> tuple[int, str]:
    """`draftwise ARGV` in this process: (exit status, stderr)."""
    from draftwise.cli.main import main

    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code
    return rc, capsys.readouterr().err


def corrupt_copy(src, dst, size: int | None):
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:size] if size is not None else b"")
    return dst


def test_cli_user_errors_are_one_line_naming_what(tmp_path, target_dir, draft_dir, capsys):
    """Every user error (bad files, options, workloads): one line on stderr naming the file or option, status 2."""
    bad_target = corrupt_copy(target_dir, tmp_path / "t", 1000)  # truncated
    bad_draft = corrupt_copy(draft_dir, tmp_path / "d", None)  # empty
    wl = tmp_path / "wl"
    wl.mkdir()
    good = '{"id": 1, "prompt": "def", "max_tokens": 2}\n'
    (wl / "bytes.jsonl").write_bytes(good.encode() + b'{"id": 2, "prompt": "a\xffb", "max_tokens": 2}\n')
    (wl / "surrogate.jsonl").write_text(good + '{"id": 2, "prompt": "a\\ud800b", "max_tokens": 2}\n')
    (wl / "temp.jsonl").write_text('{"id": 1, "prompt": "def", "max_tokens": 2, "temperature": 1e39}\n')
    (wl / "nan.jsonl").write_text('{"id": 1, "prompt": "def", "max_tokens": 2, "temperature": NaN}\n')
    m = ["--model", target_dir, "--method", "none", "--max-tokens", "2"]
    bench = ["bench", "--quick", "--out", tmp_path / "out", "--model", target_dir, "--configs", "none"]
    cases = [
        (["generate", "x", "--model", bad_target], f"{bad_target}/model.safetensors: not a readable safetensors"),
        (["generate", "x", "--model", target_dir, "--draft", bad_draft], f"{bad_draft}/model.safetensors"),
        (["generate", "x", *m, "--threads", "-3"], "argument --threads: must be an integer >= 1, got -3"),
        (["generate", "x", *m, "--threads", "0"], "argument --threads: must be an integer >= 1, got 0"),
        (["generate", "ab\udcffc", *m], "PROMPT 1: not valid UTF-8 text (byte 0xff at character 2)"),
        (["generate", "x", *m, "--stop", "\ud800"], "--stop: not valid UTF-8 text (lone surrogate"),
        (["generate", "x", *m, "--temperature", "1e39"], "temperature must be a finite number >= 0"),
        (["bench", "--threads", "-3"], "argument --threads"),
        ([*bench, "--workload", wl / "bytes.jsonl"], f"{wl}/bytes.jsonl:2: not valid UTF-8 (byte 0xff"),
        ([*bench, "--workload", wl / "surrogate.jsonl"], f"{wl}/surrogate.jsonl:2: 'prompt' is not valid text"),
        ([*bench, "--workload", wl / "temp.jsonl"], f"{wl}/temp.jsonl:1: temperature must be a finite number"),
        ([*bench, "--workload", wl / "nan.jsonl"], f"{wl}/nan.jsonl:1: temperature"),
        ([*bench, "--slo", "ttft=abc"], "--slo: could not convert"),
        ([*bench, "--concurrency", "a"], "--concurrency: invalid literal"),
        (["serve", "--threads", "0"], "argument --threads"),
        (["serve", "--port", "99999"], "argument --port"),
        (["serve", "--max-n", "0"], "argument --max-n"),
        (["serve", "--shutdown-timeout", "-1"], "argument --shutdown-timeout"),
    ]
    for argv, want in cases:
        rc, err = run_cli(argv, capsys)
        lines = err.strip().splitlines()
        assert rc == 2, (argv, err)
        assert len(lines) == 1 and "error:" in lines[0] and want in lines[0], (argv, err)


def test_cli_invalid_utf8_argument_bytes(target_dir):
    """The real path: bytes on the command line that are not UTF-8."""
    argv = [sys.executable.encode(), b"-m", b"draftwise.cli.main", b"generate", b"ab\xffc", b"--model",
            str(target_dir).encode(), b"--method", b"none"]
    r = subprocess.run(argv, capture_output=True, timeout=120)
    err = r.stderr.decode("utf-8", "replace").strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "PROMPT 1: not valid UTF-8" in err, err


def swapped_tokenizer_dir(src, dst, pairs: int):
    """A copy of `src` whose tokenizer.json maps `pairs` pairs of ids the other way round (same size)."""
    shutil.copytree(src, dst)
    f = dst / "tokenizer.json"
    tok = json.loads(f.read_text())
    vocab = tok["model"]["vocab"]
    names = sorted(vocab, key=vocab.get)[20:20 + 2 * pairs]
    for a, b in zip(names[::2], names[1::2]):
        vocab[a], vocab[b] = vocab[b], vocab[a]
    tok["model"]["merges"] = []  # merges name tokens, not ids; unused by the comparison
    f.write_text(json.dumps(tok))
    return dst


def test_swapped_tokenizer_drafts_across_vocabularies(tmp_path, target_dir, draft_dir, capsys):
    from tokenizers import Tokenizer

    from draftwise.model.vocab_check import count_differing_tokens

    def tok(d):
        return Tokenizer.from_file(str(d / "tokenizer.json"))

    same, n = count_differing_tokens(tok(target_dir), tok(draft_dir))
    assert same == 0 and n > 20
    other = swapped_tokenizer_dir(draft_dir, tmp_path / "d", pairs=3)
    assert count_differing_tokens(tok(target_dir), tok(other)) == (6, n)
    rc, err = run_cli(["generate", "def", "--model", target_dir, "--draft", other, "--max-tokens", "2"], capsys)
    assert rc == 0
    assert "drafting across vocabularies" in err
    rc, err = run_cli(["generate", "def", "--model", target_dir, "--draft", draft_dir, "--max-tokens", "2"], capsys)
    assert rc == 0 and "drafting across vocabularies" not in err


def test_train_threads_and_check_prompts_errors_are_one_line(tmp_path, target_dir, capsys):
    from draftwise.cli.main import main as cli

    with pytest.raises(SystemExit) as e:  # argparse: one line, status 2
        cli(["train", "target", "--out", str(tmp_path / "m"), "--threads", "-3"])
    assert e.value.code == 2 and "argument --threads" in capsys.readouterr().err
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"def f():\n\xff\xfe\n")
    assert cli(["check", "--model", str(target_dir), "--method", "ngram", "--prompts", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "UTF-8" in err and len(err.strip().splitlines()) == 1
