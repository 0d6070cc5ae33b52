"""`draftwise train`: train the tokenizer, the target, and a distilled draft on the stdlib corpus.

    draftwise train tokenizer --out DIR
    draftwise train target --out DIR [--tokenizer DIR] [--minutes N | --tokens N] [--resume]
    draftwise train draft --target DIR --out DIR [--minutes N | --tokens N] [--ce-only] [--resume]
    draftwise train draft --target models/smollm2 --data self --out DIR [--gen-tokens N] [--minutes N]
    draftwise train all --out models [--target-minutes N] [--draft-minutes N] [--dspark-minutes N]
    draftwise train random-draft --target DIR --out DIR [--shape draft] [--seed N]   (a useless drafter)
    draftwise train dspark --target DIR --out DIR [--minutes N | --tokens N] [--block-size G] [--data self] [--resume]
    draftwise train eagle3 --target DIR --out DIR [--minutes N | --tokens N] [--steps N] [--eval-draft DIR] [--resume]

Checkpoints go to `--ckpt-dir` (default `checkpoints/<what>`); `--resume` continues from them.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .common import add_progress_arg, positive_int
from .main import UserError


def add_parser(subparsers):
    from ..train.fit import DRAFT_DEFAULTS as D, TARGET_DEFAULTS as T

    def preset(key: str) -> str:
        return f"default: target {T[key]}, draft {D[key]}"

    p = subparsers.add_parser("train", help="train the tokenizer / target / draft on the stdlib corpus",
                              description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["tokenizer", "target", "draft", "all", "random-draft", "dspark", "eagle3"])
    p.add_argument("--out", required=True, help="output directory (HF format)")
    p.add_argument("--tokenizer", help="tokenizer directory (target; default: the one in --out, trained there first "
                                       "when missing)")
    p.add_argument("--target", help="target model directory (draft, random-draft, dspark, eagle3; a name under models/ "
                                    "counts)")
    p.add_argument("--minutes", type=float, help="training-time budget in minutes (target, draft: this or --tokens "
                                                 "is needed; all uses --target-minutes and --draft-minutes)")
    p.add_argument("--tokens", type=int, help="training budget in tokens (target, draft)")
    p.add_argument("--shape", choices=["target", "draft", "draft-wide", "tiny"],
                   help="model shape preset (default: target for target, draft for draft and random-draft, "
                        "draft-wide for draft --data self; not used with --arch hybrid)")
    p.add_argument("--arch", choices=["attention", "hybrid"], default="attention",
                   help="target: attention (Llama) or hybrid (Qwen3-Next style gated delta rule + attention; "
                        "default attention)")
    p.add_argument("--batch-size", type=int, help=f"sequences per optimizer step ({preset('batch_size')})")
    p.add_argument("--seq-len", type=int, help=f"tokens per training sequence ({preset('seq_len')})")
    p.add_argument("--lr", type=float, help=f"peak learning rate ({preset('lr')})")
    p.add_argument("--warmup", type=int, default=None, help=f"warm-up steps of the schedule ({preset('warmup_steps')})")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data order (default 0)")
    p.add_argument("--ce-only", action="store_true", help="draft: cross-entropy only, no distillation")
    p.add_argument("--alpha", type=float, default=0.9, help="draft: weight of the KL term, the rest CE (default 0.9)")
    p.add_argument("--data", choices=["corpus", "self"], default="corpus",
                   help="draft, eagle3, dspark: train on the corpus (distilling the target's distributions), or on the "
                        "target's own replies to chat prompts made from the corpus (self: generated first, "
                        "resumable; default corpus)")
    p.add_argument("--data-dir", help="--data self: where the generated shards go (default <ckpt-dir>/self_data)")
    p.add_argument("--gen-tokens", type=int, default=1_000_000,
                   help="--data self: generate until the shards hold this many tokens (0: use what is there; "
                        "default 1000000)")
    p.add_argument("--gen-max-tokens", type=positive_int, default=192,
                   help="--data self: reply length (default 192)")
    p.add_argument("--gen-model", help="--data self: the model that generates the replies (default --target; e.g. "
                                        "the same weights kept quantized, which generate faster)")
    p.add_argument("--gen-minutes", type=float,
                   help="--data self: stop generating after this many minutes (default: no limit)")
    p.add_argument("--device", default="cpu",
                   help="draft --data self: cpu or cuda (generation and training; default cpu)")
    p.add_argument("--ckpt-dir", help="checkpoint directory (default: checkpoints/target, checkpoints/target_hybrid "
                                      "with --arch hybrid, checkpoints/draft, checkpoints/draft_ce with --ce-only; "
                                      "all uses fixed directories under checkpoints/)")
    _add_dspark_args(p)
    p.add_argument("--init", help="draft: start from this model directory's weights (fresh optimizer and schedule)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --ckpt-dir")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (>= 1; default: torch's own, one per core unless OMP_NUM_THREADS says "
                        "otherwise)")
    p.add_argument("--target-minutes", type=float, default=80.0, help="all: target budget (default 80)")
    p.add_argument("--draft-minutes", type=float, default=15.0, help="all: distilled draft budget (default 15)")
    p.add_argument("--draft-continue-minutes", type=float, default=0.0,
                   help="all: then continue both drafts from their weights for this budget (distilled) / as many "
                        "tokens (CE) (default 0: no continuation)")
    p.add_argument("--dspark-minutes", type=float, default=0.0,
                   help="all: then train the embedded target's DSpark drafter (models/dspark) for this budget "
                        "(default 0: none)")
    add_progress_arg(p, "optimizer steps done / planned, loss, tokens/s")
    return p


def _add_dspark_args(p) -> None:
    from ..model.dspark_heads import HEAD_TYPES
    from ..train.dspark import DSPARK_DEFAULTS as S
    from ..train.eagle3 import EAGLE3_DEFAULTS as E

    p.add_argument("--block-size", type=positive_int, default=5,
                   help="dspark: gamma, the tokens one drafter forward proposes (default 5)")
    p.add_argument("--markov-rank", type=int, default=None,
                   help="dspark: rank of the Markov head's transition bias (default: hidden/4, at most 256)")
    p.add_argument("--markov-head", choices=list(HEAD_TYPES), default="vanilla",
                   help="dspark: the sequential stage: vanilla (a bias from the token drafted before), gated (that "
                        "bias gated by the backbone's state), rnn (a recurrent state over the block's drafted "
                        "tokens) or mlp (the vanilla bias, and h_k moved by an MLP of [h_k ; the embedding of the "
                        "token drafted before] ahead of the target's head) (default vanilla)")
    p.add_argument("--feature-layers", help="dspark, eagle3: the target's layers whose outputs the drafter reads, "
                                            "comma-separated, 0-based (default: 1, L/2, L-2, L-1)")
    p.add_argument("--backbone-layers", type=positive_int, default=1,
                   help="dspark: the drafter's transformer layers (default 1)")
    p.add_argument("--anchors", type=positive_int, default=S["anchors"],
                   help=f"dspark: blocks drawn per training window (default {S['anchors']}; batch 4 x 256 tokens, "
                        f"lr {S['lr']:g}, warm-up {S['warmup_steps']} unless set)")
    p.add_argument("--first-anchors", type=int, default=S["first_anchors"],
                   help="dspark: this many more anchors per training window whose blocks are their first row alone "
                        "(the drafter's blocks are then causal: a row reads the block's rows up to its own) "
                        f"(default {S['first_anchors']})")
    p.add_argument("--backbone-init", choices=["target", "random"], default="target",
                   help="dspark: start the backbone as the target's layers after the highest feature layer, or at "
                        "random (std 0.02) (default target)")
    p.add_argument("--steps", type=positive_int, default=5,
                   help=f"eagle3: draft steps unrolled by training-time test (default 5; batch 4 x 256 tokens, "
                        f"lr {E['lr']:g}, warm-up {E['warmup_steps']} unless set)")
    p.add_argument("--draft-vocab", type=positive_int, default=None,
                   help="eagle3, dspark: learn and draft over the target's N most frequent tokens only (the ids are "
                        "saved with the drafter, which then drafts over them by default; default: the whole "
                        "vocabulary)")
    p.add_argument("--target-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="eagle3, dspark: the dtype of the frozen target's pass (features and p); bfloat16 is several "
                        "times faster on CPUs with bfloat16 matrix units (default float32)")
    p.add_argument("--eval-draft", help="eagle3: also measure this draft model's held-out acceptance at the same "
                                        "positions (a model directory sharing the target's vocabulary; default: none)")


def _log(msg: str) -> None:
    """Training's log lines go to stderr: stdout carries the command's one JSON result."""
    print(msg, file=sys.stderr, flush=True)


def run(args) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from ..paths import resolve_model
    from ..train import pipeline

    if args.minutes is not None and args.tokens is not None:
        raise UserError("give --minutes or --tokens, not both")
    if args.data == "self" and args.what not in ("draft", "eagle3", "dspark"):
        raise UserError("--data self is for `train draft`, `train eagle3` and `train dspark` (the target's own "
                        "replies are their data)")
    if args.what not in ("eagle3", "dspark") and (args.draft_vocab is not None or args.target_dtype != "float32"):
        raise UserError("--draft-vocab and --target-dtype are for `train eagle3` and `train dspark`")
    if args.gen_tokens < 0:
        raise UserError(f"--gen-tokens must be >= 0, got {args.gen_tokens}")
    for flag in ("target_minutes", "draft_minutes", "draft_continue_minutes", "dspark_minutes"):
        if not getattr(args, flag) >= 0:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.gen_minutes is not None and not args.gen_minutes > 0:
        raise UserError(f"--gen-minutes must be > 0, got {args.gen_minutes}")
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        raise UserError(f"--device {args.device}: not available here (cpu, or cuda where a GPU is)")
    if args.target:  # a bare name is a directory under models/ (paths.resolve_model)
        args.target = str(resolve_model(args.target))
    if args.gen_model:
        args.gen_model = str(resolve_model(args.gen_model))
        if not Path(args.gen_model, "config.json").is_file():
            raise UserError(f"--gen-model {args.gen_model}: not a model directory (no config.json)")
    t0 = time.time()
    if args.what == "tokenizer":
        pipeline.train_tokenizer_dir(args.out)
    elif args.what == "target":
        pipeline.train_target(args.out, tokenizer_dir=args.tokenizer, minutes=args.minutes, tokens=args.tokens,
                              ckpt_dir=args.ckpt_dir or ("checkpoints/target_hybrid" if args.arch == "hybrid"
                                                          else "checkpoints/target"),
                              resume=args.resume, overrides=_overrides(args), arch=args.arch, log=_log,
                              progress=args.progress)
    elif args.what == "random-draft":
        if not args.target or not Path(args.target, "config.json").is_file():
            raise UserError("train random-draft needs --target DIR (a model directory: its tokenizer and vocabulary)")
        pipeline.random_draft(args.out, args.target, shape=args.shape or "draft", seed=args.seed)
    elif args.what == "dspark":
        _train_dspark(args)
    elif args.what == "eagle3":
        _train_eagle3(args)
    elif args.what == "draft":
        if not args.target:
            raise UserError("train draft needs --target DIR (the model to distil from)")
        if not Path(args.target, "config.json").is_file():
            raise UserError(f"{args.target}: not a model directory (no config.json)")
        pipeline.train_draft(args.out, args.target, minutes=args.minutes, tokens=args.tokens,
                             ckpt_dir=args.ckpt_dir or ("checkpoints/draft_ce" if args.ce_only else "checkpoints/draft"),
                             resume=args.resume, ce_only=args.ce_only, alpha=args.alpha,
                             overrides=_overrides(args), init=args.init, data=args.data, data_dir=args.data_dir,
                             gen_tokens=args.gen_tokens if args.data == "self" else 0, gen_minutes=args.gen_minutes,
                             gen_max_tokens=args.gen_max_tokens, device=args.device, log=_log, progress=args.progress,
                             gen_model=args.gen_model)
    else:
        pipeline.train_all(args.out, target_minutes=args.target_minutes, draft_minutes=args.draft_minutes,
                           resume=args.resume, draft_continue_minutes=args.draft_continue_minutes,
                           dspark_minutes=args.dspark_minutes, log=_log, progress=args.progress)
    print(json.dumps({"done": args.what, "out": args.out, "wall_seconds": round(time.time() - t0, 1)}))
    return 0


def _check_target(args) -> None:
    if not args.target:
        raise UserError(f"train {args.what} needs --target DIR (a model directory: the drafter reads its features)")
    if not Path(args.target, "config.json").is_file():
        raise UserError(f"{args.target}: not a model directory (no config.json); --target names the model the drafter reads")
    if args.minutes is None and args.tokens is None:
        raise UserError(f"train {args.what} needs --minutes or --tokens")


def _feature_layers(args) -> list[int] | None:
    """--feature-layers, checked against the target's layer count."""
    if not args.feature_layers:
        return None
    try:
        layers = [int(x) for x in args.feature_layers.split(",")]
    except ValueError:
        raise UserError(f"--feature-layers: comma-separated integers, got {args.feature_layers!r}") from None
    n = json.loads(Path(args.target, "config.json").read_text()).get("num_hidden_layers")
    if layers != sorted(set(layers)) or layers[0] < 0 or (isinstance(n, int) and layers[-1] >= n):
        raise UserError(f"--feature-layers {args.feature_layers}: strictly increasing layer ids of the target "
                        f"(0 .. {n - 1 if isinstance(n, int) else '?'})")
    return layers


def _train_dspark(args) -> None:
    from ..train.dspark import train_dspark

    _check_target(args)
    layers = _feature_layers(args)
    overrides = {k: v for k, v in _overrides(args).items() if k != "shape"}
    overrides["anchors"] = args.anchors
    if args.first_anchors < 0:
        raise UserError(f"--first-anchors must be >= 0, got {args.first_anchors}")
    overrides["first_anchors"] = args.first_anchors
    try:
        train_dspark(args.out, args.target, minutes=args.minutes, tokens=args.tokens,
                     ckpt_dir=args.ckpt_dir or "checkpoints/dspark", resume=args.resume, block_size=args.block_size,
                     markov_rank=args.markov_rank, feature_layers=layers, num_layers=args.backbone_layers,
                     from_target_layer=args.backbone_init == "target", markov_head_type=args.markov_head,
                     overrides=overrides, log=_log, progress=args.progress, **_feature_data(args))
    except ValueError as e:  # a config the target cannot serve (feature layers, rank)
        raise UserError(str(e)) from None


def _feature_data(args) -> dict:
    """A feature drafter's data and drafting vocabulary options (train eagle3, train dspark)."""
    gen = {"tokens": args.gen_tokens, "max_tokens": args.gen_max_tokens, "minutes": args.gen_minutes,
           "model": args.gen_model}
    return dict(data=args.data, data_dir=args.data_dir, draft_vocab=args.draft_vocab, target_dtype=args.target_dtype,
                gen=gen if args.data == "self" else None)


def _train_eagle3(args) -> None:
    from ..paths import resolve_model
    from ..train.eagle3 import train_eagle3

    _check_target(args)
    layers = _feature_layers(args)
    draft = None
    if args.eval_draft:
        draft = str(resolve_model(args.eval_draft))
        if not Path(draft, "config.json").is_file():
            raise UserError(f"--eval-draft {args.eval_draft}: not a model directory (no config.json)")
    overrides = {k: v for k, v in _overrides(args).items() if k != "shape"}
    try:
        train_eagle3(args.out, args.target, minutes=args.minutes, tokens=args.tokens,
                     ckpt_dir=args.ckpt_dir or "checkpoints/eagle3", resume=args.resume, steps=args.steps,
                     feature_layers=layers, overrides=overrides, log=_log, progress=args.progress, draft_dir=draft,
                     **_feature_data(args))
    except ValueError as e:  # a config the target cannot serve
        raise UserError(str(e)) from None


def _overrides(args) -> dict:
    o = {}
    for k in ("shape", "batch_size", "seq_len", "lr", "seed"):
        v = getattr(args, k)
        if v is not None:
            o[k] = v
    if args.warmup is not None:
        o["warmup_steps"] = args.warmup
    return o
