"""The training corpus: the running interpreter's standard library sources, split by path.

Files are the `*.py` files under `sysconfig.get_paths()["stdlib"]`, never `site-packages`,
and without the regression-test package (`test/`, and any `tests/` or `idle_test/` folder):
the tests double the size (31 MB vs 13 MB) and are mostly repetitive assertions.

The held-out split is a fixed list of whole packages/modules (`HELD_OUT`, about 5% of the
files): they are used for validation and as the workloads of the lab; everything else trains.
The split depends only on relative paths, so it is deterministic across machines.

It lives at the package root (it imports only the standard library) because both `train/`
(training and validation streams) and `lab/` (the shipped workloads) read it, and neither of
those imports the other. `draftwise.train.corpus` re-exports it under its former name.
"""
from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Whole packages (folders) and single modules held out for validation and lab workloads.
HELD_OUT: tuple[str, ...] = (
    "email",          # package
    "json",           # package
    "http",           # package
    "argparse.py",
    "textwrap.py",
    "fractions.py",
    "shlex.py",
    "csv.py",
    "calendar.py",
    "ftplib.py",
)

EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel: str | Path) -> bool:
    parts = Path(rel).parts
    return bool(parts) and parts[0] in HELD_OUT


def list_files(root: Path | None = None) -> list[Path]:
    """All corpus files as paths relative to `root`, sorted."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if any(p in EXCLUDED_DIRS for p in rel.parts[:-1]):
            continue
        if rel.parts[0] == "test":
            continue
        out.append(rel)
    return sorted(out, key=lambda p: p.as_posix())


@dataclass
class Split:
    root: Path
    train: list[Path]
    held_out: list[Path]

    def read(self, rel: Path) -> str | None:
        try:
            return (self.root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            return None

    def texts(self, which: str) -> list[tuple[str, str]]:
        files = self.train if which == "train" else self.held_out
        out = []
        for rel in files:
            t = self.read(rel)
            if t is not None:
                out.append((rel.as_posix(), t))
        return out


def split(root: Path | None = None) -> Split:
    root = Path(root) if root is not None else stdlib_root()
    files = list_files(root)
    return Split(root, [f for f in files if not is_held_out(f)], [f for f in files if is_held_out(f)])
