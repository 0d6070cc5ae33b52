"""Load a target model and, when speculation needs one, its draft: directories, dtypes, errors.

The one place that decides which directories and dtypes a run uses, for `LLM` (llm.py),
`draftwise bench` (lab/runner.py) and `draftwise check` (cli/check.py):

- the target is `model`, or the embedded target (`paths.default_target()`) when none is given;
- the draft is `draft`, or the embedded drafter of the method (`paths.default_draft`: models/dspark
  for dspark, the distilled draft models/draft otherwise) only when no target was given either (a
  user's target and the embedded drafters would not share a tokenizer); a method that needs a draft
  and has none fails before anything is loaded; `load_draft` loads one drafter beside a target
  already loaded (bench: each config's, lab/bench_models.py);
- the target runs in `dtype`, the draft in `draft_dtype_for(dtype, device, draft_dtype)`;
- `quantization` ("int8" or "int4": weight-only, quantize.py) applies to both, the activations keeping those dtypes,
  unless `draft_quantization` names the draft's own ("none" for float weights);
- `draft_vocab` N keeps the draft's LM head over its N most frequent tokens (draft_vocab.py), ranked
  with the draft's own tokenizer (a draft of another vocabulary included); a feature drafter (EAGLE-3,
  DSpark) then drafts with the kept rows of the target's head (eagle3_vocab.py), ranked with the
  target's;
- a draft directory that is a DSpark drafter (config.json's architectures `DSparkDrafter`) is loaded
  beside the target with `load_dspark(dir, target.model)` (model/dspark.py), in the target's dtype
  unless `draft_dtype` says otherwise, its projections packed for the CPU kernels (`prepare`): a
  `LoadedDSpark` (the `dspark` method reads it); an EAGLE-3 drafter (`Eagle3Drafter`) the same way
  with `load_eagle3`: a `LoadedEagle3` (the `eagle3` method reads it).

It takes `needs_draft: bool` rather than a proposer, so that model/ stays below proposers/.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from ..paths import default_draft, default_target, resolve_model
from . import cpu_kernels
from .config import ModelLoadError
from .draft_vocab import kept_tokens, prune_head, token_ranking
from .dspark import DSparkDrafter, load_dspark
from .dspark_config import ARCHITECTURE as DSPARK_ARCHITECTURE, DSparkConfig
from .eagle3 import Eagle3Drafter, load_eagle3
from .eagle3_config import ARCHITECTURE as EAGLE3_ARCHITECTURE, Eagle3Config
from .eagle3_vocab import prune_feature_head
from .loader import LoadedModel, load_model, resolve_dtype


def draft_dtype_for(dtype: str, device: str, draft_dtype: str | None = None) -> str:
    """The draft model's dtype: `draft_dtype` when given; on CPU bfloat16 (float32 without native
    bfloat16 products), elsewhere the target's.

    On a CPU a draft step is bound by call overhead and by re-reading its weights after each
    verification has evicted them from the caches; bfloat16 halves the bytes, and speculative
    decoding with the shipped pair ran faster with a bfloat16 draft for either target dtype, at
    the same mean accepted length. Any q keeps speculative decoding exact: the draft's precision
    only moves acceptance.

    Only where the CPU multiplies bfloat16 natively (`cpu_kernels.bf16_native`): on an AVX2-only
    CPU the draft's products beyond the fused kernels' 16 rows (batched steps, catch-up, prefill)
    run torch's generic bfloat16 matmul, several times slower than float32 there, so the draft
    runs in float32."""
    if draft_dtype:
        return draft_dtype
    if not str(device).startswith("cpu"):
        return dtype
    return "bfloat16" if cpu_kernels.bf16_native() else "float32"


@dataclass
class LoadedDSpark:
    """A DSpark drafter loaded beside its target (it shares the target's embeddings and head)."""

    path: Path
    config: DSparkConfig
    model: DSparkDrafter


@dataclass
class LoadedEagle3:
    """An EAGLE-3 drafter loaded beside its target (it shares the target's embeddings, norm and head)."""

    path: Path
    config: Eagle3Config
    model: Eagle3Drafter


class ModelPair(NamedTuple):
    target: LoadedModel
    # None: plain decoding, or a method without a draft model (n-gram); a LoadedDSpark / LoadedEagle3 for
    # a drafter directory on the target's features
    draft: LoadedModel | LoadedDSpark | LoadedEagle3 | None


# config.json's architectures of the drafters on the target's features -> (their name in errors, loader, result)
_FEATURE_DRAFTERS = {DSPARK_ARCHITECTURE: ("a DSpark", load_dspark, LoadedDSpark),
                     EAGLE3_ARCHITECTURE: ("an EAGLE-3", load_eagle3, LoadedEagle3)}


def drafter_architecture(path: str | Path) -> str | None:
    """config.json's architecture where `path` holds a drafter on the target's features (DSpark's or
    EAGLE-3's), else None (a language model, or no readable config)."""
    try:
        arch = json.loads((Path(path) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None
    return arch[0] if isinstance(arch, list) and len(arch) == 1 and arch[0] in _FEATURE_DRAFTERS else None


def is_dspark_dir(path: str | Path) -> bool:
    """Whether `path` holds a DSpark drafter (config.json's architectures), not a language model."""
    return drafter_architecture(path) == DSPARK_ARCHITECTURE


def _load_feature_drafter(path: Path, arch: str, target: LoadedModel, dtype: str, device: str,
                          draft_vocab: int | None = None):
    name, load, result = _FEATURE_DRAFTERS[arch]
    try:
        drafter = load(path, target.model, dtype=resolve_dtype(dtype)).to(device)
        if torch.device(device).type == "cpu":
            drafter.prepare()
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: not {name} drafter for the target {target.path} ({e})") from None
    try:
        prune_feature_head(drafter, target, draft_vocab)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    return result(path, drafter.cfg, drafter)


def load_pair(
    model: str | Path | None = None,
    draft: str | Path | None = None,
    *,
    needs_draft: bool,
    dtype: str = "float32",
    draft_dtype: str | None = None,
    device: str = "cpu",
    method: str = "draft",
    draft_option: str = "--draft DIR",
    quantization: str | None = None,
    draft_quantization: str | None = None,
    draft_vocab: int | None = None,
) -> ModelPair:
    """Load the target (and the draft when `needs_draft`).

    `method` and `draft_option` only word the error for a missing draft (`"draft=..."` from
    Python, `"--draft DIR"` from the command line). Errors in a directory itself (a missing
    tokenizer.json, weights, fields) are `load_model`'s `ModelLoadError`s, naming the file."""
    draft_dir = None
    if needs_draft:
        draft_dir = Path(draft) if draft else (None if model else default_draft(method))
        if draft_dir is None:
            raise ValueError(f"speculative method {method!r} needs a draft model directory ({draft_option}); "
                             "the embedded draft is the default only with the embedded target")
    draft_own = [f for f, v in (("--draft-quantization", draft_quantization), ("--draft-vocab", draft_vocab)) if v]
    if draft_dir is None and draft_own:  # (before the target loads: an error, not a minute's wait)
        raise ValueError(f"{draft_own[0]} applies to a draft model; method {method or 'none'!r} loads none")
    if draft_dir is not None:  # (a drafter's options checked before the target loads)
        check_draft_options(draft_dir, draft_quantization, draft_vocab)
    target = load_model(Path(model) if model else default_target(), dtype=dtype, device=device,
                        quantization=quantization)
    if draft_dir is None:
        return ModelPair(target, None)
    return ModelPair(target, load_draft(target, draft_dir, dtype=dtype, draft_dtype=draft_dtype, device=device,
                                        quantization=quantization, draft_quantization=draft_quantization,
                                        draft_vocab=draft_vocab))


def options_for(draft_dir: str | Path, draft_quantization: str | None, draft_vocab: int | None) -> dict:
    """Of the draft's own options, those that apply to the drafter in `draft_dir`: both to a draft
    model, --draft-vocab to a feature drafter (EAGLE-3, DSpark: its drafting head over the target
    head's rows)."""
    arch = drafter_architecture(resolve_model(draft_dir))
    if arch is None:
        return {"draft_quantization": draft_quantization, "draft_vocab": draft_vocab}
    return {"draft_quantization": None, "draft_vocab": draft_vocab}


def check_draft_options(draft_dir, draft_quantization, draft_vocab) -> None:
    """A ValueError naming the first of the draft's options that does not apply to `draft_dir`'s drafter."""
    kept = options_for(draft_dir, draft_quantization, draft_vocab)
    for flag, key, value in (("--draft-quantization", "draft_quantization", draft_quantization),
                             ("--draft-vocab", "draft_vocab", draft_vocab)):
        if value and not kept[key]:
            arch = drafter_architecture(resolve_model(draft_dir))
            raise ValueError(f"{flag} applies to a draft model, not to {_FEATURE_DRAFTERS[arch][0]} drafter")


def load_draft(target: LoadedModel, draft_dir: str | Path, *, dtype: str = "float32", draft_dtype: str | None = None,
               device: str = "cpu", quantization: str | None = None, draft_quantization: str | None = None,
               draft_vocab: int | None = None):
    """The draft in `draft_dir` beside a loaded `target` (as `load_pair` loads it): a draft model,
    or a `LoadedDSpark` / `LoadedEagle3` sharing the target's weights."""
    check_draft_options(draft_dir, draft_quantization, draft_vocab)
    arch = drafter_architecture(resolve_model(draft_dir))
    if arch is not None:
        return _load_feature_drafter(resolve_model(draft_dir), arch, target, draft_dtype or dtype, device, draft_vocab)
    dq = quantization if draft_quantization is None else draft_quantization  # ("none": load_model's float weights)
    draft_model = load_model(draft_dir, dtype=draft_dtype_for(dtype, device, draft_dtype), device=device,
                             load_tokenizer=False, quantization=dq)
    if draft_vocab is not None:
        _prune_draft_head(draft_model, target, draft_vocab)
    return draft_model


def _prune_draft_head(draft: LoadedModel, target: LoadedModel, n: int) -> None:
    """`--draft-vocab N`: the draft's head over its N most frequent tokens (draft_vocab.py), ranked with
    the draft's own tokenizer where it has one (a draft of another vocabulary: its own ids)."""
    tok = draft.tokenizer or _own_tokenizer(draft.path) or target.tokenizer
    if tok is None:
        raise ValueError("--draft-vocab: ranking the draft's tokens needs a tokenizer.json")
    always = list(tok.get_added_tokens_decoder()) + draft.eos_token_ids
    if draft.config.vocab_size == target.config.vocab_size:
        always += target.eos_token_ids
    kept = kept_tokens(token_ranking(tok), n, draft.config.vocab_size, always)
    prune_head(draft.model, kept)


def _own_tokenizer(path: Path):
    """The tokenizer in `path`/tokenizer.json, or None."""
    from tokenizers import Tokenizer

    f = Path(path) / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(f)) if f.is_file() else None
    except Exception:  # tokenizers raises a bare Exception  # noqa: BLE001
        return None
