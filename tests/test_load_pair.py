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


def test_bench_passes_the_draft_dtype(calls, target_dir, draft_dir):
    assert main(["bench", "--model", str(target_dir), "--draft", str(draft_dir), "--configs", "draft:k=2",
                 "--workload", "grounded", "--concurrency", "1", "--draft-dtype", "float32"]) == 2
    (args, kw), = calls
    assert args == (str(target_dir), str(draft_dir))
    assert kw["needs_draft"] and kw["draft_dtype"] == "float32" and kw["dtype"] == "float32"


def test_bench_without_draft_configs_needs_no_draft(calls, target_dir):
    assert main(["bench", "--model", str(target_dir), "--configs", "none,ngram:k=2", "--workload", "grounded",
                 "--concurrency", "1"]) == 2
    (_, kw), = calls
    assert kw["needs_draft"] is False and kw["draft_dtype"] is None


def test_check_passes_the_dtypes(calls, target_dir, draft_dir):
    assert main(["check", "--model", str(target_dir), "--draft", str(draft_dir), "--dtype", "bfloat16",
                 "--draft-dtype", "float32"]) == 2
    (_, kw), = calls
    assert kw["needs_draft"]
    assert (kw["dtype"], kw["draft_dtype"]) == ("bfloat16", "float32")
