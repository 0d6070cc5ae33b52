"""A bench's results as data: the versioned `results.json` document and the environment it ran in.

Schema "draftwise.bench/1": {schema, wall_seconds, created, command, environment, settings, workloads: [{name,
num_requests, sampled, truncated_prompts, runs: [{config, level, level_label, <metrics.summarize
fields>, speculation, memory, vs_none, correctness}], distribution: {config: {...}}}]}.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

from ..policies.profile import machine_info

SCHEMA = "draftwise.bench/1"


def environment() -> dict:
    import torch

    cpu = machine_info()["cpu"]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    commit = None
    try:
        repo = Path(__file__).resolve().parents[3]
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                timeout=5).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        if commit and not all(c in "0123456789abcdef" for c in commit):
            commit = None  # not a git checkout
        if commit and dirty:
            commit += "-dirty"
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu": cpu, "cpu_count": os.cpu_count(), "gpu": gpu, "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "git_commit": commit,
    }


def build_results(workloads: list[dict], settings: dict, command: list[str], wall_seconds: float | None = None) -> dict:
    return {
        "wall_seconds": wall_seconds,
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "environment": environment(),
        "settings": settings,
        "workloads": workloads,
    }
