"""Arguments shared by subcommands (model, draft, method, k, dtype) and the LLM they build."""
from __future__ import annotations

import argparse

from ..engine import SpecConfig


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (e.g. --threads; argparse names the option in its error)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {v}")
    return v


def check_text(text: str, where: str) -> str:
    """`text` if it can be encoded as UTF-8; else ValueError naming `where` (e.g. a command-line
    argument with invalid UTF-8 bytes, which Python decodes to lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        what = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"lone surrogate \\u{ord(bad):04x}"
        raise ValueError(f"{where}: not valid UTF-8 text ({what} at character {e.start})") from None
    return text


def add_quantization_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                   help="weight-only quantization of the target and the draft, made at load time: int8 = one "
                        "symmetric scale per output channel; int4 = groups of 32 with a float16 step and minimum "
                        "each (Q4_1's layout; the LM head int8); activations in --dtype (default none)")
    p.add_argument("--draft-quantization", default=None, choices=["none", "int8", "int4"],
                   help="the draft model's weight-only quantization when it should differ from --quantization "
                        "(e.g. int4 for a cheaper draft beside a target run as stored; default: --quantization)")
    p.add_argument("--draft-vocab", type=positive_int, default=None, metavar="N",
                   help="the draft's LM head over its N most frequent tokens only (counted over the training "
                        "corpus; special tokens always kept; with --method eagle3 or dspark the drafter drafts "
                        "over the target head's N most frequent rows; an EAGLE-3 or DSpark drafter trained "
                        "over N tokens drafts over those unless this is given): a cheaper draft step for large "
                        "vocabularies, output unchanged (default: the whole vocabulary)")


def draft_load_args(args) -> dict:
    """The draft's own load options (--draft-quantization, --draft-vocab) as load_pair's keywords."""
    dq = getattr(args, "draft_quantization", None)
    return {"draft_quantization": dq, "draft_vocab": getattr(args, "draft_vocab", None)}


# --method's default depends on --model and --draft (spec_from_args); each command says what follows
METHOD_HELP = ("speculative method: {methods} or none (default: draft, with the embedded draft when --model is "
               "not given or with --draft; none when --model is given without --draft)")
METHOD_HELP_CHECK = ("speculative method: {methods} (default: draft, with the embedded draft when --model is not "
                     "given or with --draft; --model without --draft needs a --method such as ngram, or a --draft)")
METHOD_HELP_PROFILE = ("speculative method: {methods} or none (default: draft when --model is not given or with "
                       "--draft, else none); a method without a draft model times no draft")


def _method_names() -> str:
    from ..proposers import available_methods

    return ", ".join(available_methods())


def add_progress_arg(p: argparse.ArgumentParser, what: str) -> None:
    """--progress / --no-progress: lab/progress.py's mode (None: a bar when stderr is a terminal)."""
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help=f"a progress bar on stderr ({what}, elapsed time, ETA); default: only when stderr is a "
                        "terminal; stdout never carries it")


def add_model_args(p: argparse.ArgumentParser, engine: bool = True, method_help: str = METHOD_HELP) -> None:
    """engine=False: a command that loads the models but runs no engine (profile): no
    --kv-cache-memory, --policy, --profile."""
    p.add_argument("--model", help="target model directory (Hugging Face format, or a name under models/); "
                                   "default: the embedded target")
    p.add_argument("--draft", help="draft model directory (a DSpark / EAGLE-3 drafter's with --method dspark / "
                                   "eagle3); default: the embedded draft when --model is not given (with "
                                   "--method dspark the embedded DSpark drafter, models/dspark), else none")
    p.add_argument("--method", default=None, help=method_help.format(methods=_method_names()))
    p.add_argument("--k", type=int, default=4, help="proposals per round (default 4)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the target's dtype (default float32)")
    p.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16"],
                   help="draft model dtype (default: bfloat16 on a CPU with native bfloat16 products, float32 on other CPUs, else --dtype)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op threads (>= 1; default: torch's own, one per core unless OMP_NUM_THREADS "
                        "says otherwise)")
    if not engine:
        return
    add_quantization_arg(p)
    p.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                   help="memory for the K/V cache pools, e.g. 2GiB or 512MB (default: room for every running "
                        "sequence's full context, at most 131072 tokens, within max(512 MiB, half the weights' "
                        "size) and half the free memory); without --max-model-len, a model context the pools "
                        "cannot hold becomes what they hold, at least 4096 tokens")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not share cached blocks of committed prompt tokens between requests")
    p.add_argument("--recurrent-rollback", default="snapshot", choices=["snapshot", "replay"],
                   help="hybrid targets (Qwen3-Next): keep the recurrent state after every verified position "
                        "(snapshot) or replay the accepted positions from the committed state (replay); "
                        "default snapshot")
    p.add_argument("--policy", default="fixed",
                   help="verification policy: fixed (verify every proposal), adaptive (per-request k from "
                        "acceptance), goodput (per-step lengths from draft confidence and the hardware "
                        "profile, under a measured check) or dspark (DSpark's prefix scheduler: proposals "
                        "admitted by survival while the profile's expected throughput rises); default fixed")
    p.add_argument("--tree", type=int, default=0, metavar="N",
                   help="draft model: draft a tree of at most --k nodes, up to N children per node; suffix: a tree of at most --k nodes, the N most frequent continuations per slot, best first by calibrated gain (draft model, greedy rows: the best --k by calibrated gain among the most probable tokens, one runner-up per slot where the drafter's steps run fused; sampled rows: grown draw by draw, without replacement, where the next draw is worth most, up to N nodes fed per drafter forward); dspark: greedy rows grow a tree of at most --k nodes, N children per node, from the block's logits and the Markov head; eagle3: greedy rows drafted in one kernel call take the chain and one runner-up per slot, the best --k nodes; 0 = chains (default 0)")
    p.add_argument("--lookup", choices=["ngram", "suffix"], default=None,
                   help="with a drafting method (draft, dspark, eagle3): n-gram lookup or suffix decoding first; a "
                        "row whose match is strong (its first proposal's estimate >= --lookup-min) verifies the "
                        "lookup's proposals, the others the drafter's (default: the drafter alone)")
    p.add_argument("--lookup-k", type=int, default=0, metavar="N",
                   help="--lookup: the lookup's proposals per round, up to 64 (default 0: --k)")
    p.add_argument("--lookup-min", type=float, default=0.75, metavar="P",
                   help="--lookup: the lookup's estimate of its first proposal's acceptance from which it drafts "
                        "the row, 0..1 (n-gram lookup's after a match of m tokens is 1 - 1/(m + 1); default 0.75)")
    p.add_argument("--profile", default=None,
                   help="hardware profile JSON for the goodput and dspark policies (default: the cached one for "
                        "this model pair, measured on first use; see `draftwise profile`)")


def add_multi_step_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--multi-step", type=positive_int, default=8, metavar="N",
                   help="plain decoding (--method none) of a lone greedy request with nothing waiting: up to N "
                        "tokens a step in one kernel call, the same tokens as one a step (default 8; 1: off)")


def spec_from_args(args) -> SpecConfig:
    method = args.method
    if method is None:
        method = "draft" if (args.draft or not args.model) else "none"
    return SpecConfig(method=None if method == "none" else method, k=args.k,
                      policy=getattr(args, "policy", "fixed"), profile=getattr(args, "profile", None),
                      tree=getattr(args, "tree", 0), lookup=getattr(args, "lookup", None),
                      lookup_k=getattr(args, "lookup_k", 0), lookup_min=getattr(args, "lookup_min", 0.75))


def build_llm(args):
    import torch

    from ..llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = spec_from_args(args)
    return LLM(args.model, draft=args.draft, spec=spec, dtype=args.dtype, device=args.device,
               draft_dtype=args.draft_dtype, quantization=args.quantization, **draft_load_args(args),
               kv_cache_memory=args.kv_cache_memory,
               enable_prefix_caching=args.prefix_caching, recurrent_rollback=args.recurrent_rollback,
               multi_step=args.multi_step)
