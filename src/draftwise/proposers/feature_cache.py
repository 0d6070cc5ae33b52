"""What the drafters on the target's features (proposers/dspark.py, proposers/eagle3.py) share: the
check of the directory they were given, and the bookkeeping of their paged caches of committed
positions (a slot per position, written once the position is committed, rolled back by
truncation; rows gathered from their slots and padded to the longest, the padding at
`HIDDEN_POSITION`, which no query sees; scratch slots past the paged ones for their kernels' own
drafting rows)."""
from __future__ import annotations

import torch

from ..kv import KVManager
from ..model.dspark import HIDDEN_POSITION
from ..model.pair import LoadedDSpark, LoadedEagle3

KINDS = {"dspark": (LoadedDSpark, "a DSpark drafter", "DSparkDrafter"),
         "eagle3": (LoadedEagle3, "an EAGLE-3 drafter", "Eagle3Drafter")}


def checked_drafter(method: str, draft, target):
    """`draft` (what load_pair loaded) if it is `method`'s kind of drafter and fits `target`; else a
    ValueError naming what it is and what to use."""
    cls, what, arch = KINDS[method]
    if not isinstance(draft, cls):
        where = ""
        if draft is not None:
            other = next((m for m, (c, _, _) in KINDS.items() if isinstance(draft, c)), None)
            where = (f"; {draft.path} is {KINDS[other][1]}: use --method {other}" if other else
                     f"; {draft.path} is a language model, not {what}")
        raise ValueError(f"speculative method '{method}' needs {what} directory (--draft DIR: "
                         f"config.json of architecture {arch} and model.safetensors){where}")
    if target is not None:
        if target.config.hybrid is not None:
            raise ValueError(f"speculative method '{method}' reads an attention-only target's features; "
                             f"{target.path} is a hybrid model")
        draft.config.check(target.config)
    return draft


def commit_slots(kv: KVManager, seq, start: int, n: int, method: str, device, own: bool = True) -> torch.Tensor:
    """The slots [n] of seq's committed positions start .. start + n - 1: the features must continue
    where the cache ends. `own`: `kv` is the drafter's own pool, whose length this makes start + n
    (blocks reserved past it truncated); else the target's, which holds them already."""
    if start != seq.draft_computed:
        raise ValueError(f"{method} drafter: features from position {start}, but its cache holds "
                         f"{seq.draft_computed} positions")
    end = start + n
    if own:
        kv.reserve(seq.seq_id, end)
        kv.truncate(seq.seq_id, end)
    return kv.slots([seq.seq_id], [end])[0, start:end].to(device)


def padded_context(kv: KVManager, seq_ids: list[int], lengths: list[int], device):
    """(slots [B, S], positions [B, S] with HIDDEN_POSITION past each row's length, the slot of each
    row's last position [B]) for rows of `lengths` committed positions."""
    slots = kv.slots(seq_ids, lengths).to(device)  # [B, S]
    S = slots.shape[1]
    pos = torch.arange(S, device=device).expand(len(seq_ids), S)
    lens = torch.tensor(lengths, device=device)[:, None]
    pos = torch.where(pos < lens, pos, torch.full_like(pos, HIDDEN_POSITION))
    return slots, pos, slots.gather(1, (lens - 1).clamp(min=0))[:, 0]


def scratch_slots(cache: torch.Tensor, num_slots: int, n: int) -> tuple[torch.Tensor, int]:
    """(the cache, the first of n scratch slots past its `num_slots` paged ones) for a kernel's drafting
    rows' own K/V (cache [..., 2, slots, Hkv, D], slots along dim 2): grown, a new tensor holding the
    paged slots' contents, where it has fewer."""
    have = cache.shape[2] - num_slots
    if have < n:
        grown = cache.new_zeros(*cache.shape[:2], num_slots + max(n, 2 * have), *cache.shape[3:])
        grown[:, :, :num_slots] = cache[:, :, :num_slots]
        cache = grown
    return cache, num_slots


def scratch_table(kv: KVManager, cache: torch.Tensor, num_slots: int, seq_ids: list[int], lengths: list[int],
                  starts: list[int], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """For a kernel call's drafting rows (rows of `lengths` committed positions whose own K/V go to
    positions starts[b] .. starts[b] + counts[b] - 1): (the cache, grown where it has too few scratch
    slots (`scratch_slots`); the slot of every position [B, Lmax] (int64): the paged ones below
    starts[b], then scratch slots; the slot of each row's last committed position L - 1, read before
    the scratch slots go in)."""
    B, stride = len(seq_ids), max(counts)
    ctx = kv.slots(seq_ids, lengths)  # [B, max L]
    Lmax = max(s + c for s, c in zip(starts, counts))
    table = torch.zeros(B, Lmax, dtype=torch.long)
    w = min(ctx.shape[1], Lmax)
    table[:, :w] = ctx[:, :w]
    rows = table.numpy()  # (row by row in numpy: each torch op costs tens of us between the kernels' calls)
    cache, base = scratch_slots(cache, num_slots, B * stride)
    last = []
    for b, (n, s, c) in enumerate(zip(lengths, starts, counts)):
        last.append(int(rows[b, max(n - 1, 0)]))
        rows[b, s: s + c] = range(base + b * stride, base + b * stride + c)
    return cache, table, last


__all__ = ["checked_drafter", "commit_slots", "padded_context", "scratch_slots", "scratch_table"]
