"""Where the embedded default models live (`models/` in the repository, or $DRAFTWISE_MODELS),
and how a model name resolves: `--model smollm2` is `models/smollm2` when no `smollm2` directory
exists where the command runs."""
from __future__ import annotations

import os
from pathlib import Path


def models_dir() -> Path:
    env = os.environ.get("DRAFTWISE_MODELS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "models"


def default_target() -> Path:
    return models_dir() / "target"


def default_draft() -> Path:
    return models_dir() / "draft"


def resolve_model(name: str | Path) -> Path:
    """A directory as given when it exists, else the directory of that name under `models/`."""
    path = Path(name)
    if path.is_dir() or path.is_absolute() or len(path.parts) != 1:
        return path
    named = models_dir() / path
    return named if named.is_dir() else path
