"""`--model NAME`: a bare name that is not a directory where the command runs is the directory of
that name under `models/` ($DRAFTWISE_MODELS), in load_model and so in every command."""
from __future__ import annotations

import shutil

import pytest

from draftwise.model import ModelLoadError, load_model
from draftwise.paths import resolve_model


@pytest.fixture
def models(tmp_path, target_dir, monkeypatch):
    root = tmp_path / "models"
    shutil.copytree(target_dir, root / "tiny")
    monkeypatch.setenv("DRAFTWISE_MODELS", str(root))
    monkeypatch.chdir(tmp_path)
    return root


def test_name_resolves_under_models(models):
    assert resolve_model("tiny") == models / "tiny"
    assert load_model("tiny", load_tokenizer=False, fuse=False).path == models / "tiny"


def test_a_local_directory_wins(models, tmp_path):
    (tmp_path / "tiny").mkdir()
    assert resolve_model("tiny").resolve() == (tmp_path / "tiny").resolve()
    assert resolve_model("sub/tiny").as_posix() == "sub/tiny"  # paths with a folder are never looked up


def test_unknown_name_error_names_both_places(models):
    with pytest.raises(ModelLoadError, match=r"nothere: model directory not found \(nor .*models/nothere\)"):
        load_model("nothere")


def test_cli_uses_the_name(models, capsys):
    from draftwise.cli.main import main

    assert main(["generate", "--model", "tiny", "--max-tokens", "4", "--json", "def"]) == 0
    assert '"token_ids"' in capsys.readouterr().out
