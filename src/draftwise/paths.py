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


# the embedded drafter of each method that reads one (the distilled draft model otherwise)
EMBEDDED_DRAFTERS = {"dspark": "dspark"}


def default_draft(method: str = "draft") -> Path:
    """The embedded target's drafter for `method`: `models/dspark` for dspark (DSpark's drafter
    on the target's features), the distilled draft model `models/draft` for the others."""
    return models_dir() / EMBEDDED_DRAFTERS.get(method, "draft")


def resolve_model(name: str | Path) -> Path:
    """A directory as given when it exists, else the directory of that name under `models/`."""
    path = Path(name)
    if path.is_dir() or path.is_absolute() or len(path.parts) != 1:
        return path
    named = models_dir() / path
    return named if named.is_dir() else path
