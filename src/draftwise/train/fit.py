"""Train one model of the pair under a budget: the shared step of `pipeline` (target) and `distill` (draft).

Holds the default hyperparameters of both roles, the periodic validation on held-out tokens and
the summary each run records (val loss, loss history, peak RSS, corpus figures). It sits below
both callers so that the draft's distillation and the end-to-end pipeline do not import each other.
"""
from __future__ import annotations

import time

from .. import corpus
from .data import Batches
from .evaluate import val_loss
from .trainer import Trainer, TrainConfig, peak_rss_mb

TARGET_DEFAULTS = dict(shape="target", batch_size=8, seq_len=512, lr=1.5e-3, warmup_steps=200)
DRAFT_DEFAULTS = dict(shape="draft", batch_size=16, seq_len=512, lr=3e-3, warmup_steps=50)
VAL_WINDOWS = 16  # periodic validation: 16 x 512 held-out tokens; the final one uses all


def corpus_stats(split, streams) -> dict:
    return {"root": str(split.root), "train_files": len(split.train), "held_out_files": len(split.held_out),
            "train_tokens": int(len(streams["train"])), "held_out_tokens": int(len(streams["val"])),
            "held_out": list(corpus.HELD_OUT)}


def train_model(model, streams, ckpt_dir, hp: dict, minutes, tokens, resume, loss_fn=None, log=None, device="cpu",
                progress: bool | None = None):
    if minutes is None and tokens is None:
        raise ValueError("give a budget: --minutes or --tokens")
    cfg = TrainConfig(ckpt_dir=str(ckpt_dir), batch_size=hp["batch_size"], seq_len=hp["seq_len"], lr=hp["lr"],
                      warmup_steps=hp["warmup_steps"], seed=hp.get("seed", 0), max_tokens=tokens, minutes=minutes,
                      device=str(device))
    seq = hp["seq_len"]
    trainer = Trainer(model, Batches(streams["train"], cfg.batch_size, seq, seed=cfg.seed), cfg,
                      eval_fn=lambda m: val_loss(m, streams["val"], seq, VAL_WINDOWS), log=log, progress=progress,
                      **({"loss_fn": loss_fn} if loss_fn else {}))
    if resume:
        trainer.resume()
    t0 = time.time()
    summary = trainer.run()
    summary["wall_seconds_this_run"] = round(time.time() - t0, 1)
    model.eval()
    summary["val_loss"] = round(val_loss(model, streams["val"], seq), 4)
    summary["history"] = trainer.history
    summary["peak_rss_mb"] = round(peak_rss_mb())
    return summary
