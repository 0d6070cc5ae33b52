"""The training loop shared by the target and the drafts.

AdamW (fused on CPU when available) with decoupled weight decay on matrices only, linear
warm-up then cosine decay to `min_lr_ratio * lr`, bfloat16 autocast on CPU (where the CPU multiplies
bfloat16 natively: `cpu_kernels.bf16_native`; float32 elsewhere), gradient clipping,
seeded. Budgets: `max_tokens` fixes the number of steps and the cosine runs over steps (fully
deterministic); with `minutes` the cosine runs over the measured training time (the sum of step
times, saved in checkpoints), so the schedule ends when the time is spent even when other
processes share the CPU. Warm-up is counted in steps in both cases.

Checkpoints (`ckpt.pt` in the checkpoint dir, written atomically every `ckpt_every_s` seconds
and at the end) hold model, optimizer, RNG states, the step (= data position, see `data.Batches`),
the fixed step count and the elapsed training time, so a resumed run continues exactly where
the interrupted one stopped. Progress: a rich bar (steps, loss, tokens/s, ETA) on stderr where
stderr is a terminal or `progress` forces it, plain log lines otherwise. Peak RSS comes from `resource.getrusage`.
"""
from __future__ import annotations

import json
import math
import os
import random
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..model.cpu_kernels import bf16_native
from .data import Batches


@dataclass
class TrainConfig:
    ckpt_dir: str
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    max_tokens: int | None = None
    minutes: float | None = None
    ckpt_every_s: float = 180.0
    log_every_s: float = 20.0
    autocast: bool = True
    device: str = "cpu"  # "cuda" when a GPU is lent: bfloat16 autocast there
    extra: dict = field(default_factory=dict)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def lr_at(step: int, frac: float, cfg: TrainConfig) -> float:
    """Learning rate at `step`; `frac` in [0, 1] is the progress through the decay phase."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, max(0.0, frac))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def ce_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a `[B, T+1]` batch."""
    logits = model.logits(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])


class Trainer:
    def __init__(self, model: torch.nn.Module, batches: Batches, cfg: TrainConfig,
                 loss_fn: Callable = ce_loss, eval_fn: Callable | None = None, log=None,
                 progress: bool | None = None):
        self.model, self.batches, self.cfg, self.loss_fn, self.eval_fn = model, batches, cfg, loss_fn, eval_fn
        self.opt = make_optimizer(model, cfg)
        self.step = 0
        self.total_steps = self._fixed_total()
        self.elapsed = 0.0
        self.warmup_end_s: float | None = None
        self.history: list[dict] = []
        self.ckpt_path = Path(cfg.ckpt_dir) / "ckpt.pt"
        self.log = log or (lambda msg: print(msg, flush=True))
        self.progress = progress  # the bar: True forced, False off, None where stderr is a terminal
        self.device = torch.device(cfg.device)
        model.to(self.device)
        self.autocast = cfg.autocast and (self.device.type == "cuda" or bf16_native())
        if cfg.autocast and not self.autocast:
            self.log("this CPU has no native bfloat16 products: training in float32")
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.seq_len

    def _fixed_total(self) -> int | None:
        if self.cfg.max_tokens is not None:
            return max(1, self.cfg.max_tokens // (self.cfg.batch_size * self.cfg.seq_len))
        return None

    # -- checkpoints ---------------------------------------------------------------------------
    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.step,
                "total_steps": self.total_steps, "elapsed": self.elapsed, "warmup_end_s": self.warmup_end_s, "rng": _rng_state(),
                "history": self.history, "config": asdict(self.cfg)}

    def save(self) -> None:
        self.ckpt_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.ckpt_path.with_suffix(".tmp")
        torch.save(self.state(), tmp)
        os.replace(tmp, self.ckpt_path)

    def resume(self) -> bool:
        if not self.ckpt_path.is_file():
            return False
        s = torch.load(self.ckpt_path, weights_only=False, map_location="cpu")
        self.model.load_state_dict(s["model"])  # (onto the model's device)
        self.opt.load_state_dict(s["optim"])
        self.step, self.total_steps, self.elapsed = s["step"], s["total_steps"], s["elapsed"]
        self.warmup_end_s = s.get("warmup_end_s")
        self.history = s.get("history", [])
        _set_rng_state(s["rng"])
        self.log(f"resumed from {self.ckpt_path} at step {self.step} ({self.elapsed:.0f}s trained)")
        return True

    # -- loop ----------------------------------------------------------------------------------
    def train_step(self, batch: torch.Tensor, lr: float) -> float:
        for g in self.opt.param_groups:
            g["lr"] = lr
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.loss_fn(self.model, batch.to(self.device))
        loss.backward()
        if self.cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def _decay_frac(self) -> float:
        """Progress through the decay phase (after warm-up): by steps, or by training time."""
        cfg = self.cfg
        if cfg.max_tokens is not None:
            return (self.step - cfg.warmup_steps) / max(1, self.total_steps - cfg.warmup_steps)
        start = self.warmup_end_s if self.warmup_end_s is not None else self.elapsed
        return (self.elapsed - start) / max(1e-9, cfg.minutes * 60 - start)

    def _done(self) -> bool:
        if self.cfg.max_tokens is not None:
            return self.step >= self.total_steps
        return self.elapsed >= self.cfg.minutes * 60

    def run(self, stop_after: int | None = None) -> dict:
        """Train to the budget (or `stop_after` more steps, for tests); returns a summary."""
        cfg = self.cfg
        if cfg.max_tokens is None and cfg.minutes is None:
            raise ValueError("give a budget: max_tokens or minutes")
        self.model.train()
        show = self.progress if self.progress is not None else sys.stderr.isatty()
        bar = _Bar(forced=bool(self.progress)) if show else None
        last_ckpt = last_log = time.time()
        ema, step_time, run_steps = None, None, 0
        try:
            while not self._done():
                if stop_after is not None and run_steps >= stop_after:
                    break
                t0 = time.perf_counter()
                batch = self.batches.get(self.step)
                loss = self.train_step(batch, lr_at(self.step, self._decay_frac(), cfg))
                dt = time.perf_counter() - t0
                self.elapsed += dt
                self.step += 1
                run_steps += 1
                if self.step == cfg.warmup_steps:
                    self.warmup_end_s = self.elapsed
                step_time = dt if step_time is None else 0.9 * step_time + 0.1 * dt
                if cfg.max_tokens is None:  # estimate, for display only
                    left = max(0.0, cfg.minutes * 60 - self.elapsed)
                    self.total_steps = self.step + int(left / max(step_time, 1e-9))
                ema = loss if ema is None else 0.98 * ema + 0.02 * loss
                tps = self.tokens_per_step / step_time
                eta = ((self.total_steps - self.step) * step_time if cfg.max_tokens is not None
                       else max(0.0, cfg.minutes * 60 - self.elapsed))
                now = time.time()
                if bar:
                    bar.update(self.step, self.total_steps, ema, tps, eta)
                if now - last_log >= cfg.log_every_s or self._done():
                    last_log = now
                    rec = {"step": self.step, "tokens": self.step * self.tokens_per_step, "loss": round(ema, 4),
                           "lr": self.opt.param_groups[0]["lr"], "tok_s": round(tps),
                           "elapsed_s": round(self.elapsed), "peak_rss_mb": round(peak_rss_mb())}
                    self.history.append(rec)
                    if not bar:
                        self.log(f"step {self.step}/{self.total_steps} loss {ema:.4f} {tps:.0f} tok/s "
                                 f"eta {eta / 60:.1f} min rss {peak_rss_mb():.0f} MB")
                if now - last_ckpt >= cfg.ckpt_every_s:
                    last_ckpt = now
                    self._eval_and_save()
        finally:
            if bar:
                bar.close()
        self._eval_and_save()
        return self.summary()

    def _eval_and_save(self) -> None:
        if self.eval_fn is not None:
            self.model.eval()
            val = self.eval_fn(self.model)
            self.model.train()
            self.history.append({"step": self.step, "val_loss": round(val, 4)})
            self.log(f"step {self.step}: val loss {val:.4f}")
        self.save()

    def summary(self) -> dict:
        return {"steps": self.step, "tokens": self.step * self.tokens_per_step,
                "train_seconds": round(self.elapsed, 1), "peak_rss_mb": round(peak_rss_mb()),
                "tokens_per_second": round(self.step * self.tokens_per_step / max(self.elapsed, 1e-9)),
                "final_train_loss": next((h["loss"] for h in reversed(self.history) if "loss" in h), None),
                "bfloat16_autocast": self.autocast,  # cfg.autocast, where the CPU has native bfloat16
                "config": asdict(self.cfg)}


class _Bar:
    """A rich progress bar showing loss, tokens/s and ETA."""

    def __init__(self, forced: bool = False):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        # stderr: stdout carries the command's result; forced: drawn even into a file or a pipe
        console = Console(stderr=True, force_terminal=True if forced else None)
        self.p = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:.0f} tok/s"),
                          TextColumn("ETA {task.fields[eta]}"), TimeRemainingColumn(), console=console)
        self.p.start()
        self.task = self.p.add_task("train", total=None, loss=0.0, tps=0.0, eta="?")

    def update(self, step, total, loss, tps, eta):
        self.p.update(self.task, completed=step, total=total, loss=loss, tps=tps,
                      eta=f"{int(eta // 60)}:{int(eta % 60):02d}")

    def close(self):
        self.p.stop()


def write_json(path: str | Path, obj) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2) + "\n")
