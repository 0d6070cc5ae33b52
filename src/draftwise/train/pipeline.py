"""End-to-end steps used by `draftwise train`: tokenizer, target, draft, and `all`."""
from __future__ import annotations

import time
from pathlib import Path

import torch


from .. import corpus
from .data import load_streams
from .distill import train_draft
from .export import export_model
from .fit import TARGET_DEFAULTS, corpus_stats, train_model
from .shapes import HYBRID, PRESETS, build_model, count_params, hybrid_config, llama_config
from .tokenizer import EOS, load_tokenizer, save_tokenizer, train_tokenizer


def train_tokenizer_dir(out: str | Path) -> dict:
    t0 = time.time()
    split = corpus.split()
    texts = [t for _, t in split.texts("train")]
    tok = train_tokenizer(texts)
    save_tokenizer(tok, out)
    return {"files": len(texts), "seconds": round(time.time() - t0, 1)}


def _setup(tokenizer_dir: Path, ckpt_dir: Path):
    tok = load_tokenizer(tokenizer_dir)
    split = corpus.split()
    streams = load_streams(tok, split, ckpt_dir)
    return tok, split, streams


def train_target(out, tokenizer_dir=None, minutes=None, tokens=None, ckpt_dir="checkpoints/target",
                 resume=False, overrides=None, log=None, arch: str = "attention", progress: bool | None = None) -> dict:
    """arch: "attention" (Llama, the shipped target) or "hybrid" (Qwen3-Next style, shapes.HYBRID)."""
    out, ckpt_dir = Path(out), Path(ckpt_dir)
    if tokenizer_dir is None:
        tokenizer_dir = out
        if not (out / "tokenizer.json").is_file():
            train_tokenizer_dir(out)
    hp = dict(TARGET_DEFAULTS, **(overrides or {}))
    tok, split, streams = _setup(Path(tokenizer_dir), ckpt_dir)
    eos = tok.token_to_id(EOS)
    if arch == "hybrid":
        cfg_dict = hybrid_config(HYBRID, tok.get_vocab_size(), eos)
    else:
        cfg_dict = llama_config(PRESETS[hp["shape"]], tok.get_vocab_size(), eos)
    model = build_model(cfg_dict, seed=hp.get("seed", 0))
    summary = train_model(model, streams, ckpt_dir, hp, minutes, tokens, resume, log=log, progress=progress)
    summary.update(role="target", arch=arch, parameters=count_params(model), corpus=corpus_stats(split, streams))
    export_model(model, out, tokenizer_dir, summary)
    return summary


def train_all(out, target_minutes=80.0, draft_minutes=15.0, resume=False, draft_continue_minutes=0.0,
              dspark_minutes=0.0, log=None, progress: bool | None = None) -> dict:
    """Tokenizer, target, distilled draft, then the CE-only comparison draft (same shape, same
    number of training tokens as the distilled one; kept in checkpoints/, not shipped), then
    the evaluation and the model card. With `draft_continue_minutes`, both drafts then continue
    from their weights (fresh optimizer, lr 1.5e-3, warm-up 20, data seed 1): the distilled one
    for that budget, the CE-only one for the same number of tokens (the shipped draft was made so).
    With `dspark_minutes`, a DSpark drafter on the target's features (`out/dspark`, bfloat16
    weights, train/dspark.py's defaults) before the model card."""
    from .dspark import train_dspark
    from .report import write_model_card

    out = Path(out)
    t0 = time.time()
    tok_dir = Path("checkpoints/tokenizer")
    train_tokenizer_dir(tok_dir)
    shown = {"log": log, "progress": progress}
    train_target(out / "target", tokenizer_dir=tok_dir, minutes=target_minutes, resume=resume, **shown)
    hp = {"warmup_steps": 50}
    kd = train_draft(out / "draft", out / "target", minutes=draft_minutes, resume=resume, overrides=hp, **shown)
    ce_dir = Path("checkpoints/draft_ce_model")
    train_draft(ce_dir, out / "target", tokens=kd["tokens"], resume=resume, ce_only=True,
                ckpt_dir="checkpoints/draft_ce", overrides=hp, **shown)
    if draft_continue_minutes:
        hp2 = {"lr": 1.5e-3, "warmup_steps": 20, "seed": 1}
        kd2 = train_draft(out / "draft", out / "target", minutes=draft_continue_minutes, resume=resume,
                          ckpt_dir="checkpoints/draft_long", overrides=hp2, init=out / "draft", **shown)
        train_draft(ce_dir, out / "target", tokens=kd2["tokens"], resume=resume, ce_only=True,
                    ckpt_dir="checkpoints/draft_ce_long", overrides=hp2, init=ce_dir, **shown)
    if dspark_minutes:
        train_dspark(out / "dspark", out / "target", minutes=dspark_minutes, ckpt_dir="checkpoints/dspark",
                     resume=resume, save_dtype=torch.bfloat16, **shown)
    write_model_card(out, ce_draft_dir=ce_dir, total_wall_s=time.time() - t0)
    return {"wall_seconds": round(time.time() - t0, 1)}


def random_draft(out, target_dir, shape: str = "draft", seed: int = 0) -> dict:
    """A randomly initialised draft with the target's tokenizer and vocabulary: a useless drafter
    (its proposals are almost never accepted), to measure what speculation costs when it fails."""
    from ..model.config import ModelConfig

    tcfg = ModelConfig.from_dir(target_dir)
    eos = tcfg.eos_token_id[0] if tcfg.eos_token_id else 0
    cfg = llama_config(PRESETS[shape], tcfg.vocab_size, eos, tcfg.bos_token_id,
                       max_position_embeddings=tcfg.max_position_embeddings)
    model = build_model(cfg, seed=seed)
    export_model(model, out, target_dir, {"random_init": True, "seed": seed, "shape": shape,
                                          "parameters": count_params(model)})
    return {"out": str(out), "parameters": count_params(model)}
