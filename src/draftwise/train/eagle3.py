"""Training an EAGLE-3 drafter (model/eagle3.py) with training-time test: `draftwise train eagle3`.

One frozen target forward over a batch of corpus windows gives what the drafter reads (the chosen
layers' outputs at every position) and what it learns (p, the target's next-token distribution
after every position): no generation. The drafter then unrolls `steps` draft steps over every
position of the window at once (`Eagle3Drafter.unroll`): step 1 reads the target's features,
step j > 1 the drafter's own step-(j-1) outputs, each step attending what inference attends.

Loss: the cross-entropy against the target's distribution at every unrolled step,

    sum_j w_j mean_t [ -sum_x p_{t+j}(x) log q_j(x | t) ] / sum_j w_j,   w_j = 0.8^(j-1)

(EAGLE-3's soft labels and depth weights; no feature-regression term). The drafter starts with
its projections at std 0.02 and fc_in as the sum of its two inputs (starting its layer as a copy of
a target layer, as DSpark does, gave a higher loss after 60 steps: 6.20 against 5.90). The loop,
the schedule, checkpoints (resume) and progress are train/trainer.py's.

Data: the corpus's windows, or (`--data self`) the target's own replies to chat prompts
(self_data.py: prompt and reply, teacher-forced like any window). With `draft_vocab` N the drafter
learns and drafts over the target's N most frequent tokens only (eagle3_vocab.py): its head is those
rows of the target's, the loss reads p on them (-sum over the kept x of p(x) log q(x)), the ids are
saved with its weights, and the held-out acceptance is that of the pruned drafter against the
whole p. `target_dtype` bfloat16 runs the frozen target's pass in bfloat16 (on CPUs with bfloat16
matrix units several times faster than float32); the drafter keeps its float32 weights and the
trainer's autocast.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import corpus
from ..model.draft_vocab import PrunedHead
from ..model.eagle3 import Eagle3Drafter, save_eagle3
from ..model.eagle3_config import Eagle3Config
from ..model.loader import load_model
from .data import Batches, eval_windows
from .eagle3_eval import eagle3_acceptance
from .feature_data import DATA_KINDS, kept_rows_head, kept_tokens, training_streams
from .fit import corpus_stats
from .trainer import Trainer, TrainConfig, peak_rss_mb

EAGLE3_DEFAULTS = dict(batch_size=4, seq_len=256, lr=3e-3, warmup_steps=20, seed=0)
STEP_DECAY = 0.8  # w_j = 0.8^(j-1), as EAGLE-3
VAL_WINDOWS = 8  # periodic validation (loss); the final acceptance reads up to EVAL_WINDOWS
EVAL_WINDOWS = 32
EVAL_ANCHORS = 48  # blocks per held-out window (the DSpark evaluation's)


def ttt_loss(step_logits: list[torch.Tensor], p: torch.Tensor, decay: float = STEP_DECAY):
    """step_logits [steps] of [B, T-1, V] (`unroll`), p [B, T, V] the target's distribution after each
    position -> (loss, per-step soft cross-entropies [steps]). Step j's row t is compared with
    p[t + j] (j = 1..steps); rows with t + j > T - 1 do not count."""
    T = p.shape[1]
    losses, weights = [], []
    for j, logits in enumerate(step_logits, start=1):
        n = T - j  # rows t = 0 .. T-1-j have a distribution to learn
        if n <= 0:
            break
        logq = F.log_softmax(logits[:, :n].float(), -1)
        losses.append(-(p[:, j:].float() * logq).sum(-1).mean())
        weights.append(decay ** (j - 1))
    per_step = torch.stack(losses)
    w = torch.tensor(weights)
    return (per_step * w).sum() / w.sum(), per_step.detach()


def _target_pass(target, ids: torch.Tensor, layers: tuple[int, ...], kept: torch.Tensor | None = None):
    """ids [B, T] -> features [B, T, F*H], p [B, T, V] (the frozen target's; [B, T, N] at the kept
    tokens only with `kept`)."""
    with torch.no_grad():
        hidden, feats = target(ids, feature_layers=layers)
        p = torch.softmax(target.compute_logits(hidden).float(), -1)
    return feats, (p if kept is None else p[..., kept])


def eagle3_loss_fn(target, steps: int, kept: torch.Tensor | None = None):
    """`(drafter, batch [B, T]) -> loss` for the Trainer."""

    def loss_fn(drafter, batch):
        feats, p = _target_pass(target, batch, tuple(drafter.cfg.target_feature_layers), kept)
        return ttt_loss(drafter.unroll(feats, batch, steps), p)[0]

    return loss_fn


@torch.no_grad()
def val_loss(drafter, target, windows: torch.Tensor, steps: int, kept: torch.Tensor | None = None) -> float:
    total = 0.0
    for w in windows.split(2):
        feats, p = _target_pass(target, w, tuple(drafter.cfg.target_feature_layers), kept)
        total += float(ttt_loss(drafter.unroll(feats, w, steps), p)[0]) * w.shape[0]
    return total / max(1, windows.shape[0])


def build_drafter(tcfg, target_model, steps: int, feature_layers, seed: int, target: str = "",
                  kept: torch.Tensor | None = None) -> Eagle3Drafter:
    """A fresh drafter: projections at std 0.02, fc_in the sum of its inputs; `kept` the token ids it
    drafts over (None: all)."""
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(tcfg, steps=steps, feature_layers=feature_layers, target=target)
    cfg.draft_vocab = 0 if kept is None else len(kept)
    drafter = Eagle3Drafter(cfg.check(tcfg))
    if kept is not None:
        drafter.draft_vocab_ids.copy_(kept)
    for m in drafter.modules():
        if isinstance(m, torch.nn.Linear) and m is not drafter.fc_in:
            torch.nn.init.normal_(m.weight, std=0.02)
    return drafter.share(target_model)


def train_eagle3(out, target_dir, minutes=None, tokens=None, ckpt_dir="checkpoints/eagle3", resume=False,
                 steps: int = 5, feature_layers: list[int] | None = None, overrides=None, log=None,
                 progress: bool | None = None, draft_dir: str | Path | None = None, data: str = "corpus",
                 data_dir: str | Path | None = None, gen: dict | None = None, draft_vocab: int | None = None,
                 target_dtype: str = "float32") -> dict:
    """Train, save the drafter in `out`, and write `out`/training.json with the held-out acceptance of
    the drafter and (with `draft_dir`) of a separate draft model at the same positions. `gen`
    (tokens, max_tokens, minutes, model): with data "self", generate the replies first (resumable;
    by `model`, default the target: e.g. the same weights kept quantized, faster)."""
    if minutes is None and tokens is None:
        raise ValueError("give a budget: --minutes or --tokens")
    if data not in DATA_KINDS:
        raise ValueError(f"data: corpus or self, got {data!r}")
    out, target_dir, ckpt_dir = Path(out), Path(target_dir), Path(ckpt_dir)
    if data == "self" and data_dir is None:
        data_dir = ckpt_dir / "self_data"
    hp = dict(EAGLE3_DEFAULTS, **(overrides or {}))
    loaded = load_model(target_dir, dtype=target_dtype, fuse=False)
    target = loaded.model.eval().requires_grad_(False)
    kept = kept_tokens(loaded, draft_vocab)
    drafter = build_drafter(loaded.config, target, steps, feature_layers, hp["seed"],
                            target=os.path.relpath(target_dir.resolve(), out.resolve()), kept=kept)
    if kept is not None:
        head_rows = kept_rows_head(target, kept)
        drafter.set_head(head_rows)
    split = corpus.split()
    streams = training_streams(loaded, target_dir, ckpt_dir, split, data, data_dir, gen or {}, log)
    cfg = TrainConfig(ckpt_dir=str(ckpt_dir), batch_size=hp["batch_size"], seq_len=hp["seq_len"], lr=hp["lr"],
                      warmup_steps=hp["warmup_steps"], seed=hp["seed"], max_tokens=tokens, minutes=minutes,
                      weight_decay=0.0)
    val = eval_windows(streams["val"], hp["seq_len"], VAL_WINDOWS)
    trainer = Trainer(drafter, Batches(streams["train"], cfg.batch_size, cfg.seq_len, seed=cfg.seed), cfg,
                      loss_fn=eagle3_loss_fn(target, steps, kept),
                      eval_fn=(lambda d: val_loss(d, target, val, steps, kept)) if len(val) else None,
                      log=log, progress=progress)
    if resume:
        trainer.resume()
    summary = trainer.run()
    drafter.eval()
    save_eagle3(drafter, out)
    if kept is not None:  # evaluated as it drafts: q over the kept tokens, none elsewhere
        drafter.set_head(PrunedHead(head_rows, kept, loaded.config.vocab_size))
    held_out = eval_windows(streams["val"], hp["seq_len"], EVAL_WINDOWS)
    summary.update(role="eagle3", target=str(target_dir), history=trainer.history, peak_rss_mb=round(peak_rss_mb()),
                   trainable_parameters=sum(p.numel() for p in drafter.parameters()),
                   objective=f"soft CE against p at each of {steps} unrolled steps, weights {STEP_DECAY}^(j-1)",
                   corpus=corpus_stats(split, streams) if data == "corpus" else {"self_data": str(data_dir)},
                   data=data, draft_vocab=0 if kept is None else len(kept), target_dtype=target_dtype,
                   held_out={"eagle3": eagle3_acceptance(drafter, target, held_out, EVAL_ANCHORS, steps)}
                   if len(held_out) else {"note": "no held-out window (too little data)"})
    if draft_dir is not None and len(held_out):
        from .dspark_eval import draft_acceptance

        draft = load_model(draft_dir, dtype="float32", fuse=False, load_tokenizer=False).model.eval()
        summary["held_out"]["draft"] = draft_acceptance(draft, target, held_out, EVAL_ANCHORS, steps)
        summary["held_out"]["draft_dir"] = str(draft_dir)
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    if log:
        for name, acc in summary["held_out"].items():
            if isinstance(acc, dict):
                log(f"held-out {name}: c* per step {acc['per_position']}, greedy agreement "
                    f"{acc['greedy_per_position']}, expected accepted {acc['expected_accepted']:.3f} of {steps} "
                    f"(greedy {acc['greedy_accepted']:.3f})")
    return summary
