"""Where the embedded default models live (`models/` in the repository, or $DRAFTWISE_MODELS)."""
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
