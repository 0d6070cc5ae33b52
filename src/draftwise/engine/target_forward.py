"""The target's forward of one engine step: decoding rows (last committed + proposals) and prefill
chunks, one forward per group (or one for both on a mixed step).

With `feature_layers` (a proposer that reads the target's features: proposers/dspark.py) the
forward also returns those layers' outputs for every fed row; they are kept per sequence with the
position of its first fed row, and postprocess hands the committed ones to the proposer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..model.runner import ModelRunner
from ..proposers import DraftBlock
from .scheduler import ScheduledSeq
from .speculation import NO_DRAFT
from .tree_verify import tree_spec


@dataclass
class TargetForward:
    sampling: list[ScheduledSeq]  # the sequences that commit a token this step
    logits: torch.Tensor | None  # [N, V]: 1 + num_draft rows each, in `sampling` order
    prefill_seconds: float = 0.0  # the prefill group's forward (the decode-step cost model leaves it out)
    mixed: bool = False  # decode rows and prefill chunks ran in one forward
    # seq_id -> (position of its first fed row, features [fed rows, F * hidden]); with feature_layers only
    features: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)


def forward_target(runner: ModelRunner, scheduled: list[ScheduledSeq], blocks: dict[int, DraftBlock],
                   mixed: bool, feature_layers: tuple[int, ...] = ()) -> TargetForward:
    """One target forward per group: decoding sequences (last committed + proposals), then prefill
    chunks; one forward for both when `mixed` (the scheduler kept the chunks short)."""
    groups = ([s for s in scheduled if not s.seq.is_prefilling], [s for s in scheduled if s.seq.is_prefilling])
    out = TargetForward([], None, mixed=bool(mixed and groups[0] and groups[1]))
    if out.mixed:
        groups = (list(scheduled), [])
    parts = []
    for group in groups:
        if not group:
            continue
        feeds, starts, nlog, prov, trees = [], [], [], [], []
        for s in group:
            seq = s.seq
            d = (blk := blocks.get(seq.seq_id, NO_DRAFT)).token_ids
            trees.append(tree_spec(seq.num_computed + s.num_new_tokens - 1, blk))  # None: a chain
            feeds.append(seq.all_ids[seq.num_computed : seq.num_computed + s.num_new_tokens] + d)
            starts.append(seq.num_computed)
            nlog.append(1 + len(d) if s.samples else 1)
            prov.append(bool(d))  # a hybrid target's state through proposals waits for postprocess
        t0 = time.perf_counter()
        logits = runner.run([s.seq.seq_id for s in group], feeds, starts, nlog, provisional=prov, trees=trees,
                            feature_layers=feature_layers)
        if feature_layers:
            logits, feats = logits  # [sum(nlog), V], [sum(len(feeds)), F * hidden]
            off = 0
            for s, start, feed in zip(group, starts, feeds):
                out.features[s.seq.seq_id] = (start, feats[off : off + len(feed)])
                off += len(feed)
        if group is groups[1]:
            out.prefill_seconds = time.perf_counter() - t0
        off = 0
        for s, n in zip(group, nlog):
            if s.samples:
                out.sampling.append(s)
                parts.append(logits[off : off + n])
            off += n
    if parts:
        out.logits = torch.cat(parts) if len(parts) > 1 else parts[0]
    return out
