"""The hardware profile as a record: measured forward times of one model pair on one machine, the
cost model fitted to them, and the identity of what was measured.

A `HardwareProfile` is a versioned JSON file (FORMAT): machine, torch, device, threads, dtypes,
model fingerprints (`model_fingerprint`: cheap, content-based), settings, the grid, what was
skipped, the fitted cost model and its error on the grid. measure.py measures one; profile.py
finds or measures the one a run needs.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..model.loader import LoadedModel
from ..model.quantize import quantization_of
from .cost import CostModel, GridCost

FORMAT = "draftwise.profile/1"
FINGERPRINT_BYTES = 1 << 20  # hashed at each end of each weight file


@dataclass
class GridPoint:
    """One measured target forward: B sequences, T new tokens each, at context C."""

    num_seqs: int
    tokens_per_seq: int
    context: int
    seconds: float  # median of `repeats` timed runs
    repeats: int = 1


@dataclass
class DraftPoint:
    """One measured drafter step: B sequences, one new token each, at context C."""

    num_seqs: int
    context: int
    seconds: float
    repeats: int = 1


@dataclass
class HardwareProfile:
    machine: dict  # platform, cpu, cpu_count
    torch: str
    device: str
    threads: int
    dtype: str
    draft_dtype: str | None
    models: dict  # {"target": {"path", "fingerprint"}, "draft": {...} | None}
    settings: dict  # max_num_seqs, k, contexts, budget_seconds, repeats
    grid: list[GridPoint]
    draft_grid: list[DraftPoint]
    cost: CostModel
    fit: dict = field(default_factory=dict)  # relative errors of the fit on the grid
    skipped: list[dict] = field(default_factory=list)  # points left out to stay in the budget
    measured_seconds: float = 0.0
    created: str = ""

    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "created": self.created, "measured_seconds": self.measured_seconds,
            "machine": self.machine, "torch": self.torch, "device": self.device, "threads": self.threads,
            "dtype": self.dtype, "draft_dtype": self.draft_dtype, "models": self.models, "settings": self.settings,
            "cost_model": self.cost.to_dict(), "fit": self.fit,
            "grid": [asdict(p) for p in self.grid], "draft_grid": [asdict(p) for p in self.draft_grid],
            "skipped": self.skipped,
        }

    @staticmethod
    def from_dict(d: dict) -> "HardwareProfile":
        return HardwareProfile(
            machine=dict(d["machine"]), torch=str(d["torch"]), device=str(d["device"]), threads=int(d["threads"]),
            dtype=str(d["dtype"]), draft_dtype=d["draft_dtype"], models=dict(d["models"]),
            settings=dict(d["settings"]), grid=[GridPoint(**p) for p in d["grid"]],
            draft_grid=[DraftPoint(**p) for p in d["draft_grid"]], cost=CostModel.from_dict(d["cost_model"]),
            fit=dict(d.get("fit", {})), skipped=list(d.get("skipped", [])),
            measured_seconds=float(d.get("measured_seconds", 0.0)), created=str(d.get("created", "")),
        )

    def grid_cost(self) -> CostModel:
        """The cost model the goodput policy uses: the measured grid (GridCost), or the fit alone
        when the profile has no grid."""
        if not self.grid:
            return self.cost
        return GridCost(self.cost, [(p.num_seqs, p.tokens_per_seq, p.context, p.seconds) for p in self.grid])

    def save(self, path: str | Path) -> Path:
        """Write the JSON (atomically: a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path

    @staticmethod
    def load(path: str | Path) -> "HardwareProfile":
        path = Path(path)
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"{path}: hardware profile not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a readable hardware profile ({e})") from None
        found = d.get("format") if isinstance(d, dict) else None
        if found != FORMAT:
            raise ValueError(f"{path}: hardware profile format {found!r}, this draftwise reads {FORMAT!r}; "
                             "measure it again with `draftwise profile`")
        try:
            return HardwareProfile.from_dict(d)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: malformed hardware profile ({type(e).__name__}: {e})") from None


# ---- identity: machine, models ------------------------------------------------------------------

def machine_info() -> dict:
    """The platform, the CPU model (with the vector extension torch dispatches to) and its cores."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    # the vector extension torch dispatches to: one CPU name can cover AVX2-only and AVX-512 parts,
    # whose step times differ several-fold in bfloat16
    try:
        cpu = f"{cpu} [{torch.backends.cpu.get_cpu_capability()}]"
    except (AttributeError, RuntimeError):
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count()}


def model_fingerprint(path: str | Path) -> str:
    """sha256 of config.json and, per weight file, its name, size and first and last MiB.

    Content-based (a copied directory keeps its fingerprint) and cheap (at most 2 MiB read per
    file); a retrained model changes its tensors, hence the bytes hashed."""
    path = Path(path)
    h = hashlib.sha256()
    cfg = path / "config.json"
    h.update(cfg.read_bytes() if cfg.is_file() else b"")
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(FINGERPRINT_BYTES))
            if size > FINGERPRINT_BYTES:
                fh.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
                h.update(fh.read())
    return h.hexdigest()


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def model_entry(m: LoadedModel | None) -> dict | None:
    """What a profile records of a model: its path, fingerprint and weight quantization."""
    if m is None:
        return None
    return {"path": str(m.path), "fingerprint": model_fingerprint(m.path), "quantization": quantization_of(m.model)}
