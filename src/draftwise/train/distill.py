"""Draft training: distillation from the target's next-token distributions.

Loss per position: `alpha * KL(p_target || q_draft) + (1 - alpha) * CE(q_draft, next token)`
(forward KL at temperature 1, summed over the vocabulary, averaged over positions). The target
runs in bfloat16 without gradients on the same batch; nothing is precomputed. `ce_only=True`
trains the same draft shape on cross-entropy alone (the comparison baseline). The draft shares
the target's tokenizer and is at most 1/8 of its parameters.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model.config import ModelConfig
from ..model.loader import load_model
from .. import corpus
from . import self_data
from .data import load_streams
from .export import export_model
from .fit import DRAFT_DEFAULTS, corpus_stats, train_model
from .shapes import PRESETS, build_model, count_params, llama_config
from .trainer import ce_loss


def kd_loss_fn(teacher, alpha: float = 0.9):
    """A loss function `(draft, batch) -> loss` distilling `teacher` into the draft."""

    def loss_fn(model, batch):
        x, y = batch[:, :-1], batch[:, 1:]
        with torch.no_grad():
            t_logp = F.log_softmax(teacher.logits(x).float(), dim=-1)
        s_logits = model.logits(x)
        s_logp = F.log_softmax(s_logits.float(), dim=-1)
        V = s_logp.shape[-1]
        kl = F.kl_div(s_logp.reshape(-1, V), t_logp.reshape(-1, V), log_target=True, reduction="batchmean")
        if alpha >= 1.0:
            return kl
        ce = F.nll_loss(s_logp.reshape(-1, V), y.reshape(-1))
        return alpha * kl + (1 - alpha) * ce

    return loss_fn


def train_draft(out, target_dir, minutes=None, tokens=None, ckpt_dir="checkpoints/draft", resume=False,
                ce_only=False, alpha=0.9, overrides=None, log=None, init=None, data="corpus", data_dir=None,
                gen_tokens=0, gen_minutes=None, gen_max_tokens=192, device="cpu", progress: bool | None = None,
                gen_model=None) -> dict:
    out, target_dir, ckpt_dir = Path(out), Path(target_dir), Path(ckpt_dir)
    hp = dict(DRAFT_DEFAULTS, **(overrides or {}))
    split = corpus.split()
    gen = None
    if data == "self":
        hp = dict(hp, shape=(overrides or {}).get("shape", "draft-wide"))
        data_dir = Path(data_dir) if data_dir is not None else ckpt_dir / "self_data"
        if gen_tokens:
            gen = self_data.generate(gen_model or target_dir, data_dir, gen_tokens, max_tokens=gen_max_tokens,
                                     device=device, minutes=gen_minutes, log=log or print)
        teacher = None  # the replies are the labels: the target's config is all the training needs
        tcfg = ModelConfig.from_dir(target_dir)
        streams = self_data.load_streams(data_dir, tcfg.eos_token_id[0])
        ce_only = True
    else:
        teacher = load_model(target_dir, dtype="bfloat16")
        tcfg = teacher.config
        streams = load_streams(teacher.tokenizer, split, ckpt_dir)
    cfg_dict = llama_config(PRESETS[hp["shape"]], tcfg.vocab_size, tcfg.eos_token_id[0], tcfg.bos_token_id,
                            tcfg.max_position_embeddings)
    model = build_model(cfg_dict, seed=hp.get("seed", 0))
    previous = None
    if init is not None:
        if not resume:
            _warm_start(model, Path(init))
        prev_file = Path(init) / "training.json"
        if prev_file.is_file():  # the record of the run this one continues (without its loss history)
            previous = {k: v for k, v in json.loads(prev_file.read_text()).items() if k != "history"}
    loss_fn = ce_loss if ce_only else kd_loss_fn(teacher.model, alpha)
    summary = train_model(model, streams, ckpt_dir, hp, minutes, tokens, resume, loss_fn=loss_fn, log=log,
                          device=device, progress=progress)
    model.cpu()
    if init is not None:
        summary["init"] = str(init)
        summary["continued_from"] = previous
    objective = ("cross-entropy on the target's own replies (sequence-level distillation)" if data == "self"
                 else "cross-entropy" if ce_only else f"forward KL (alpha={alpha}) + CE")
    summary.update(role="draft", objective=objective, parameters=count_params(model), target=str(target_dir),
                   target_parameters=tcfg.num_parameters(), corpus=corpus_stats(split, streams))
    if data == "self":
        summary["self_data"] = gen or json.loads((data_dir / "manifest.json").read_text())
    export_model(model, out, target_dir, summary)
    return summary


def _warm_start(model, init: Path) -> None:
    """Copy the weights of the draft in `init` (a model directory of the same shape) into `model`;
    optimizer and schedule start fresh (a continued run, not a resumed one)."""
    src = load_model(init, dtype="float32", fuse=False, load_tokenizer=False).model.state_dict()
    dst = model.state_dict()
    bad = [k for k in dst if k not in src or src[k].shape != dst[k].shape]
    if bad:
        raise ValueError(f"{init}: weights do not match the draft shape (first mismatch: {bad[0]})")
    model.load_state_dict({k: src[k] for k in dst})
