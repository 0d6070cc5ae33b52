"""`load_pair`: the target + draft loading shared by LLM, bench and check (dirs, dtypes, errors)."""
import pytest
import torch

from draftwise.cli.main import main
from draftwise.model import pair
from draftwise.model.pair import load_pair


def _dtype(loaded):
    return next(loaded.model.parameters()).dtype


def test_dtypes_target_and_draft(target_dir, draft_dir):
    target, draft = load_pair(target_dir, draft_dir, needs_draft=True)
    default = torch.bfloat16 if pair.cpu_kernels.bf16_native() else torch.float32  # the CPU default
    assert _dtype(target) == torch.float32 and _dtype(draft) == default
    assert target.tokenizer is not None and draft.tokenizer is None
    target, draft = load_pair(target_dir, draft_dir, needs_draft=True, dtype="bfloat16", draft_dtype="float32")
    assert _dtype(target) == torch.bfloat16 and _dtype(draft) == torch.float32


def test_no_draft_when_not_needed(target_dir, draft_dir):
    target, draft = load_pair(target_dir, draft_dir, needs_draft=False)
    assert draft is None and target.path == target_dir


def test_embedded_defaults(tmp_path, monkeypatch, target_dir, draft_dir):
    (tmp_path / "target").symlink_to(target_dir)
    (tmp_path / "draft").symlink_to(draft_dir)
    monkeypatch.setenv("DRAFTWISE_MODELS", str(tmp_path))
    target, draft = load_pair(needs_draft=True)
    assert target.path == tmp_path / "target" and draft.path == tmp_path / "draft"


def test_a_given_target_never_gets_the_embedded_draft(tmp_path, monkeypatch):
    """The error comes before anything is loaded (the target directory here does not exist)."""
    monkeypatch.setenv("DRAFTWISE_MODELS", str(tmp_path))
    with pytest.raises(ValueError, match=r"'draft' needs a draft model directory \(draft=\.\.\.\)"):
        load_pair(tmp_path / "nowhere", needs_draft=True, method="draft", draft_option="draft=...")


class Stop(ValueError):
    pass


@pytest.fixture
def calls(monkeypatch):
    """Record the arguments `bench` and `check` pass to load_pair, then stop the command."""
    seen = []

    def fake(*args, **kwargs):
        seen.append((args, kwargs))
        raise Stop("stopped after load_pair")

    monkeypatch.setattr(pair, "load_pair", fake)
    return seen


@pytest.fixture
def bench_calls(monkeypatch):
    """Record what `bench` passes to load_pair (the target) and load_draft (each drafter), then stop
    the command at its first drafter (lab/bench_models.py)."""
    from draftwise.lab import bench_models

    seen = []

    def fake_pair(*args, **kwargs):
        seen.append(("pair", args, kwargs))
        return load_pair(*args, **kwargs)

    def fake_draft(*args, **kwargs):
        seen.append(("draft", args, kwargs))
        raise Stop("stopped at load_draft")

    monkeypatch.setattr(bench_models, "load_pair", fake_pair)
    monkeypatch.setattr(bench_models, "load_draft", fake_draft)
    return seen


def test_bench_passes_the_draft_dtype(bench_calls, target_dir, draft_dir):
    assert main(["bench", "--model", str(target_dir), "--draft", str(draft_dir), "--configs", "draft:k=2",
                 "--workload", "grounded", "--concurrency", "1", "--draft-dtype", "float32"]) == 2
    (_, args, kw), (_, dargs, dkw) = bench_calls
    assert args == (str(target_dir), None) and kw["dtype"] == "float32"
    assert dargs[1] == str(draft_dir) and dkw["draft_dtype"] == "float32" and dkw["dtype"] == "float32"


def test_bench_without_draft_configs_needs_no_draft(bench_calls, target_dir, tmp_path):
    assert main(["bench", "--model", str(target_dir), "--configs", "none,ngram:k=2", "--workload", "grounded",
                 "--concurrency", "1", "--num-requests", "1", "--max-tokens", "2", "--no-progress",
                 "--out", str(tmp_path / "b")]) == 0
    assert [c[0] for c in bench_calls] == ["pair"] and bench_calls[0][2]["needs_draft"] is False


def test_check_passes_the_dtypes(calls, target_dir, draft_dir):
    assert main(["check", "--model", str(target_dir), "--draft", str(draft_dir), "--dtype", "bfloat16",
                 "--draft-dtype", "float32"]) == 2
    (_, kw), = calls
    assert kw["needs_draft"]
    assert (kw["dtype"], kw["draft_dtype"]) == ("bfloat16", "float32")
