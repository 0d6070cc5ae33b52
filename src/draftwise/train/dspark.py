"""Training a DSpark drafter (model/dspark.py) on its target's features: `draftwise train dspark`.

One frozen target forward over a batch of windows gives both what the drafter reads (the chosen
layers' outputs at every position) and what it learns (p, the target's next-token distribution):
no generation. The windows are the corpus's, or (`--data self`) the target's own replies to chat
prompts (train/feature_data.py, as `train eagle3`). With `--draft-vocab N` the drafter learns over
the target's N most frequent tokens (its head those rows, the Markov bias over the same tokens; q
and p over `kept_alphabet`: those tokens and the rest of the vocabulary as one entry, where q has
no mass, so TV is still the whole vocabulary's), saves their ids and drafts over them.
Blocks start at anchors drawn along each window (`sample_anchors`); block n at anchor a reads the
context before a and predicts x_{a+1..a+gamma} (the window's tokens) with q_k, teacher-forced: the
Markov head and the confidence head read the true x_{k-1}.

Loss per position k = 1..gamma, weighted by exp(-(k-1)/decay) (decay = gamma unless set; DSpark
uses 4 for gamma 7) and normalised by the weights' sum:

    0.1 CE(q_k, x_{a+k}) + 0.9 TV(q_k, p_k) + 1.0 BCE(c_k, c*_k),   c*_k = 1 - TV(q_k, p_k)

with TV = 0.5 ||q - p||_1 (the reference code weights the L1 norm itself, 2 TV) and c*_k the
probability that a draw from q_k is accepted against p_k, held fixed in the BCE. Forward KL
(soft CE against p_k) in place of the TV term learned no faster on the embedded target (8 minutes
each: 1.26 tokens expected accepted within 5 against 1.31). The loop, the schedule, checkpoints
(resume) and progress are train/trainer.py's.

The backbone's first layer starts as the target layer after the highest feature layer
(`init_from_target_layer`; `--backbone-init random` starts it at random, the same within the
run-to-run spread after 8 minutes) and the learning rate is 5e-3 (docs/ARCHITECTURE.md, DSpark).
Per wall-clock time 48 anchors per window learnt faster than 16 or 192 (`--anchors`).
`--first-anchors N` adds N anchors per window whose blocks are their first row alone (the drafter's
blocks are then causal: model/dspark.py), cheap rows of the position every accepted block starts
with. After training, the confidences are calibrated by
Sequential Temperature Scaling on held-out windows (train/dspark_calibration.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import corpus
from ..model.draft_vocab import PrunedHead
from ..model.dspark import DSparkDrafter, save_dspark
from ..model.dspark_config import DSparkConfig
from ..model.loader import load_model
from .data import Batches, eval_windows
from .dspark_blocks import block_forward, position_weights, sample_anchors
from .dspark_calibration import calibrate
from .dspark_eval import block_acceptance
from .feature_data import DATA_KINDS, kept_rows_head, kept_tokens, training_streams
from .fit import corpus_stats
from .trainer import Trainer, TrainConfig, peak_rss_mb

DSPARK_DEFAULTS = dict(batch_size=4, seq_len=256, lr=5e-3, warmup_steps=20, anchors=48, first_anchors=0, seed=0)
VAL_WINDOWS = 8  # periodic validation (loss); the final acceptance reads up to EVAL_WINDOWS
EVAL_WINDOWS = 32
EVAL_ANCHORS = 48  # held-out blocks per window, whatever --anchors trains: runs stay comparable


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    confidence: float = 1.0


def dspark_loss(q_logits, p, labels, conf_logits, weights, w: LossWeights = LossWeights()):
    """q_logits, p [..., V] (p: probabilities); labels, conf_logits, weights [...] -> (loss, terms).
    terms: the weighted means of ce, tv and bce, and c* (detached), for logs and tests. A label -1 (a
    token the drafter cannot draft: `kept_alphabet`) has no CE term."""
    logq = F.log_softmax(q_logits.float(), dim=-1)
    has = labels >= 0
    ce = torch.where(has, -logq.gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1), 0.0)
    tv = 0.5 * (logq.exp() - p.float()).abs().sum(-1)
    c_star = (1.0 - tv).detach().clamp(0.0, 1.0)
    bce = F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")
    norm = weights / weights.sum().clamp_min(1e-9)
    terms = {"ce": (ce * norm).sum(), "tv": (tv * norm).sum(), "bce": (bce * norm).sum(), "c_star": c_star}
    loss = w.ce * terms["ce"] + w.tv * terms["tv"] + w.confidence * terms["bce"]
    return loss, terms


def dspark_loss_fn(target, anchors: int, decay: float, weights: LossWeights = LossWeights(),
                   first_anchors: int = 0, kept: torch.Tensor | None = None):
    """`(drafter, batch [B, T+1]) -> loss` for the Trainer (anchors from the global RNG, which the
    Trainer seeds and checkpoints). `first_anchors`: that many more anchors per window whose blocks
    are their first row alone (a causal block's drafter), in the same loss as the blocks' rows.
    `kept`: the tokens the drafter's training head gives logits of (`block_forward`)."""

    def loss_fn(drafter, batch):
        a = sample_anchors(batch.shape[0], batch.shape[1], anchors)
        if not first_anchors:
            q_logits, p, conf, labels, valid = block_forward(drafter, target, batch, a, kept=kept)
            return dspark_loss(q_logits, p, labels, conf, position_weights(valid, decay), weights)[0]
        a1 = sample_anchors(batch.shape[0], batch.shape[1], first_anchors)
        parts = block_forward(drafter, target, batch, a, a1, kept=kept)  # the blocks', then the first rows'
        w = torch.cat([position_weights(part[4], decay).reshape(-1) for part in parts])
        q_logits, p, conf, labels, _ = (torch.cat([x.reshape(-1, *x.shape[3:]) for x in xs]) for xs in zip(*parts))
        return dspark_loss(q_logits, p, labels, conf, w, weights)[0]

    return loss_fn


@torch.no_grad()
def val_loss(drafter, target, windows: torch.Tensor, anchors: int, decay: float,
             kept: torch.Tensor | None = None) -> float:
    """The loss on held-out windows with fixed anchors (a seeded generator: comparable over time)."""
    g = torch.Generator().manual_seed(0)
    total = 0.0
    for w in windows.split(2):
        a = sample_anchors(w.shape[0], w.shape[1], anchors, g)
        q_logits, p, conf, labels, valid = block_forward(drafter, target, w, a, kept=kept)
        total += float(dspark_loss(q_logits, p, labels, conf, position_weights(valid, decay))[0]) * w.shape[0]
    return total / max(1, windows.shape[0])


def build_drafter(tcfg, target_model, block_size: int, markov_rank: int | None, feature_layers, seed: int,
                  target: str = "", from_target_layer: bool = True, num_layers: int = 1,
                  anchor_feature: bool = True, markov_head_type: str = "vanilla",
                  causal_block: bool = False, draft_vocab: torch.Tensor | None = None) -> DSparkDrafter:
    """A fresh drafter; its final norm starts as the target's (both feed the same LM head), and with
    `from_target_layer` its layers as `init_from_target_layer` says; `draft_vocab` the token ids it
    drafts over (None: all)."""
    torch.manual_seed(seed)
    cfg = DSparkConfig.for_target(tcfg, block_size=block_size, markov_rank=markov_rank,
                                  feature_layers=feature_layers, num_layers=num_layers, target=target,
                                  anchor_feature=anchor_feature, markov_head_type=markov_head_type,
                                  causal_block=causal_block)
    cfg.draft_vocab = 0 if draft_vocab is None else len(draft_vocab)
    drafter = DSparkDrafter(cfg.check(tcfg))
    if draft_vocab is not None:
        drafter.draft_vocab_ids.copy_(draft_vocab)
    for m in drafter.modules():
        if isinstance(m, torch.nn.Linear) and m is not drafter.confidence and m is not drafter.fc_in:
            torch.nn.init.normal_(m.weight, std=0.02)
    with torch.no_grad():
        drafter.norm.weight.copy_(target_model.model.norm.weight.float())
        if draft_vocab is not None and drafter.markov is not None:  # a bias it never drafts: zero
            off = torch.ones(cfg.vocab_size, dtype=torch.bool)
            off[draft_vocab] = False
            drafter.markov.w2.weight[off] = 0.0
    if from_target_layer:
        init_from_target_layer(drafter, target_model)
    return drafter.share(target_model)


@torch.no_grad()
def init_from_target_layer(drafter: DSparkDrafter, target_model) -> bool:
    """Start backbone layer i as the target layer l + 1 + i (where there is one), l the highest
    feature layer below the target's last, and the fusion as (nearly) picking layer l's output: the
    first layer's context K/V are then the target's own keys and values at layer l + 1, so the block
    rows attend by the target's learnt relative positions from the first step instead of uniformly
    (faster early learning on a CPU budget). False (nothing changed) where no feature layer lies
    below the target's last."""
    layers = target_model.model.layers
    below = [i for i in drafter.cfg.target_feature_layers if i + 1 < len(layers)]
    if not below:
        return False
    top, h = below[-1], drafter.cfg.hidden_size
    for i, dst in enumerate(drafter.layers):
        if top + 1 + i >= len(layers):
            break
        src = layers[top + 1 + i]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(dst, name).weight.copy_(getattr(src.self_attn, name).weight.float())
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(dst, name).weight.copy_(getattr(src.mlp, name).weight.float())
        for name in ("input_layernorm", "post_attention_layernorm"):
            getattr(dst, name).weight.copy_(getattr(src, name).weight.float())
    drafter.hidden_norm.weight.copy_(layers[top + 1].input_layernorm.weight.float())
    slot = drafter.cfg.target_feature_layers.index(top)
    drafter.fc.weight.mul_(0.1)
    drafter.fc.weight[:, slot * h:(slot + 1) * h] += torch.eye(h)
    return True


def train_dspark(out, target_dir, minutes=None, tokens=None, ckpt_dir="checkpoints/dspark", resume=False,
                 block_size: int = 5, markov_rank: int | None = None, feature_layers: list[int] | None = None,
                 decay: float | None = None, num_layers: int = 1, anchor_feature: bool = True,
                 from_target_layer: bool = True, markov_head_type: str = "vanilla", overrides=None, log=None,
                 progress: bool | None = None, save_dtype: torch.dtype = torch.float32, data: str = "corpus",
                 data_dir: str | Path | None = None, gen: dict | None = None, draft_vocab: int | None = None,
                 target_dtype: str = "float32") -> dict:
    """Train, calibrate, save the drafter in `out` and write `out`/training.json. `data` "self": the
    target's own replies in `data_dir` (generated first where `gen` asks, as `train eagle3`);
    `draft_vocab` N: the head over the target's N most frequent tokens (their ids saved with the
    drafter, which drafts over them by default); `target_dtype` bfloat16: the frozen target's pass in
    bfloat16 (the drafter's head then reads the head's rows in float32)."""
    if minutes is None and tokens is None:
        raise ValueError("give a budget: --minutes or --tokens")
    if data not in DATA_KINDS:
        raise ValueError(f"data: corpus or self, got {data!r}")
    out, target_dir, ckpt_dir = Path(out), Path(target_dir), Path(ckpt_dir)
    if data == "self" and data_dir is None:
        data_dir = ckpt_dir / "self_data"
    hp = dict(DSPARK_DEFAULTS, **(overrides or {}))
    loaded = load_model(target_dir, dtype=target_dtype, fuse=False)
    target = loaded.model.eval().requires_grad_(False)
    vocab = loaded.config.vocab_size
    kept = kept_tokens(loaded, draft_vocab)
    drafter = build_drafter(loaded.config, target, block_size, markov_rank, feature_layers, hp["seed"],
                            target=os.path.relpath(target_dir.resolve(), out.resolve()), num_layers=num_layers,
                            anchor_feature=anchor_feature, from_target_layer=from_target_layer,
                            markov_head_type=markov_head_type,
                            causal_block=hp["first_anchors"] > 0, draft_vocab=kept)  # (checks the config first)
    head = None
    if kept is not None or target_dtype != "float32":
        head = kept_rows_head(target, kept if kept is not None else torch.arange(vocab))
        drafter.set_head(head)
        if drafter.markov is not None and kept is not None:
            drafter.markov.restrict(kept)
    split = corpus.split()
    streams = training_streams(loaded, target_dir, ckpt_dir, split, data, data_dir, gen or {}, log)
    decay = float(decay or block_size)
    cfg = TrainConfig(ckpt_dir=str(ckpt_dir), batch_size=hp["batch_size"], seq_len=hp["seq_len"], lr=hp["lr"],
                      warmup_steps=hp["warmup_steps"], seed=hp["seed"], max_tokens=tokens, minutes=minutes,
                      weight_decay=0.0)
    val = eval_windows(streams["val"], hp["seq_len"], VAL_WINDOWS)
    trainer = Trainer(drafter, Batches(streams["train"], cfg.batch_size, cfg.seq_len, seed=cfg.seed), cfg,
                      loss_fn=dspark_loss_fn(target, hp["anchors"], decay, first_anchors=hp["first_anchors"],
                                             kept=kept),
                      eval_fn=(lambda d: val_loss(d, target, val, EVAL_ANCHORS, decay, kept)) if len(val) else None,
                      log=log, progress=progress)
    if resume:
        trainer.resume()
    summary = trainer.run()
    drafter.eval()
    if kept is not None:  # evaluated as it drafts: q over the kept tokens, none elsewhere
        if drafter.markov is not None:
            drafter.markov.restrict(None)
        drafter.set_head(PrunedHead(head, kept, vocab))
    held_out = eval_windows(streams["val"], hp["seq_len"], EVAL_WINDOWS)
    summary.update(role="dspark", target=str(target_dir), history=trainer.history, peak_rss_mb=round(peak_rss_mb()),
                   trainable_parameters=sum(p.numel() for p in drafter.parameters()),
                   objective=f"0.1 CE + 0.9 TV + 1.0 BCE(c, 1 - TV), position weights exp(-(k-1)/{decay:g})",
                   anchors_per_window=hp["anchors"], first_position_anchors_per_window=hp["first_anchors"],
                   causal_block=drafter.cfg.causal_block, markov_head_type=markov_head_type,
                   backbone_init="target" if from_target_layer else "random",
                   corpus=corpus_stats(split, streams) if data == "corpus" else {"self_data": str(data_dir)},
                   data=data, draft_vocab=0 if kept is None else len(kept), target_dtype=target_dtype)
    if len(held_out):
        summary["held_out"] = block_acceptance(drafter, target, held_out, EVAL_ANCHORS)
        # Sequential Temperature Scaling: fitted on the held-out windows above, tested on the next ones
        calib_test = eval_windows(streams["val"], hp["seq_len"], 2 * EVAL_WINDOWS)[EVAL_WINDOWS:]
        summary["calibration"] = calibrate(drafter, target, held_out, calib_test, EVAL_ANCHORS)
    else:
        summary["held_out"] = {"note": "no held-out window (too little data)"}
    save_dspark(drafter, out, dtype=save_dtype)  # (the figures above: the float32 weights)
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    if log and len(held_out):
        acc = summary["held_out"]
        log(f"held-out acceptance (c* = 1 - TV) per position {acc['per_position']}, expected accepted "
            f"{acc['expected_accepted']:.3f} of {block_size}")
        cal = summary["calibration"]
        log(f"confidence temperatures {cal['temperatures']}: ECE of the survival {cal['before']['ece']:.4f} "
            f"before, {cal['after']['ece']:.4f} after (other held-out windows)")
    return summary
