"""A feature-reading drafter's directory (DSpark's, EAGLE-3's): config.json beside model.safetensors
holding the drafter's own weights only (the target's embeddings, final norm and LM head are shared,
not saved). Loading checks every tensor against the module the config describes: one missing, of
another shape or not described at all is a `ModelLoadError` naming it."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from .config import ModelLoadError


def save_drafter(drafter: nn.Module, config: dict, out: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """config.json (`config`) + model.safetensors (the module's state dict in `dtype`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous()
             for k, v in drafter.state_dict().items()}  # (integer buffers, such as token ids, stay integers)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def load_drafter_weights(drafter: nn.Module, path: str | Path) -> nn.Module:
    """Fill `drafter` (built from the directory's config.json) from `path`/model.safetensors."""
    f = Path(path) / "model.safetensors"
    if not f.is_file():
        raise ModelLoadError(f"{f}: not found")
    try:
        state = load_file(str(f))
    except Exception as e:  # a truncated or foreign file
        raise ModelLoadError(f"{f}: unreadable ({e})") from None
    expected = drafter.state_dict()
    bad = [k for k in expected if k not in state or state[k].shape != expected[k].shape]
    if bad:
        raise ModelLoadError(f"{f}: tensor {bad[0]!r} missing or of another shape")
    unknown = sorted(k for k in state if k not in expected)
    if unknown:
        raise ModelLoadError(f"{f}: tensor {unknown[0]!r} is not part of the drafter config.json describes "
                             "(its fields disagree with the weights)")
    drafter.load_state_dict(state)
    return drafter
