"""The models an in-process bench run loads: the target once, and each drafting config's drafter (a
draft model, a DSpark or an EAGLE-3 drafter), each directory once.

A config's drafter is the directory its own `:draft=DIR` names (a path, or a name under models/),
else `--draft`, else, with the embedded target, the embedded drafter of its method
(`paths.default_draft`: models/dspark for dspark, models/draft for the others). So one run puts a
draft model, a DSpark drafter and n-gram lookup side by side, time-sliced on the same machine state.
The draft's own options (--draft-quantization, --draft-vocab) apply to the drafters they fit
(model/pair.py's `options_for`); one that fits none of the run's drafters is an error, as it is
for a single drafter.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model.pair import check_draft_options, load_draft, load_pair, options_for
from ..paths import default_draft


@dataclass
class BenchModels:
    target: object  # LoadedModel
    drafts: dict[str, object]  # config label -> its drafter (configs that draft with a model only)

    def draft(self, label: str):
        return self.drafts.get(label)

    def max_len(self) -> int:
        """The longest context every model of the run holds."""
        return min([self.target.config.max_position_embeddings]
                   + [d.config.max_position_embeddings for d in self.drafts.values()])


def draft_dirs(plan, drafting) -> dict[str, str]:
    """label -> drafter directory of each config in `drafting` (configs whose method needs one); a
    ValueError naming the first config that has none."""
    out = {}
    for c in drafting:
        d = c.draft or plan.draft or (None if plan.model else str(default_draft(c.method)))
        if d is None:
            raise ValueError(f"speculative method {c.method!r} needs a draft model directory (--draft DIR, or "
                             f"{c.method}:...:draft=DIR in --configs); the embedded drafters are the default only "
                             "with the embedded target")
        out[c.label] = d
    return out


def load_bench_models(plan, drafting) -> BenchModels:
    """The target (plan.model, or the embedded one) and the drafters of the configs in `drafting`."""
    dirs = draft_dirs(plan, drafting)
    own = {"draft_quantization": plan.draft_quantization, "draft_vocab": plan.draft_vocab}
    fits = {d: options_for(d, **own) for d in dict.fromkeys(dirs.values())}
    for key, flag in (("draft_quantization", "--draft-quantization"), ("draft_vocab", "--draft-vocab")):
        if own[key] and not any(o[key] for o in fits.values()):
            if not dirs:
                raise ValueError(f"{flag} applies to a draft model; no config of this run loads one")
            check_draft_options(next(iter(fits)), **own)  # (raises, naming the drafter)
    target, _ = load_pair(plan.model, None, needs_draft=False, dtype=plan.dtype, device=plan.device,
                          quantization=plan.quantization)
    loaded = {d: load_draft(target, d, dtype=plan.dtype, draft_dtype=plan.draft_dtype, device=plan.device,
                            quantization=plan.quantization, **fits[d]) for d in fits}
    return BenchModels(target, {label: loaded[d] for label, d in dirs.items()})
