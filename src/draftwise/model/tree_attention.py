"""Tree attention: a block of rows that form a tree, on the same flat slot cache.

A verification (or drafting) block may hold several continuations of one context: its rows form
a tree. Each row still writes its K/V at the next key index of its sequence (row r of a call
that starts at key index `start` owns key `start + r`), so the block needs no slots of its own;
what changes is what a row attends and where it sits:

- `TreeSpec(base, parents)`: keys from `base` on form the tree zone; key `base + j` hangs under
  key `base + parents[j]` (-1: directly under the context, keys 0..base-1). Keys before `base`
  are an ordinary causal prefix (the committed context, or a catch-up fed in the same call).
- A zone row attends every context key, its ancestors in the zone and itself, never a sibling
  or a cousin; its position (RoPE) is `base + depth` (depth 0 for a row under the context), the
  position it will have once its path is committed. The K/V of a path is therefore exactly what
  a chain over that path would have written, only at other key indices: after verification the
  accepted path's K/V are moved to consecutive keys (`ModelRunner.move_kv`) and the rest is
  rolled back by bookkeeping, as a rejected chain's is.
- A chain is the tree whose parents are (-1, 0, 1, ...) (positions = key indices).

`kernel_trees` lays the trees out for the fused CPU kernels (kernels/attention.c, dw_attend_batch),
which attend the same keys and sum them in the order a chain over the row's path would.
`tree_metadata` builds the PyTorch path's `AttentionMetadata` for a padded batch in which some
sequences carry a tree (a per-row boolean mask `[B, 1, T, L]`); the others are causal as usual.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionMetadata


@dataclass(frozen=True)
class TreeSpec:
    base: int  # key index of the zone's first key
    parents: tuple[int, ...]  # [Z] parent of key base + j, relative to base; -1: the context; parents[j] < j

    def __post_init__(self):
        for j, p in enumerate(self.parents):
            if not -1 <= p < j:
                raise ValueError(f"tree key {j}: parent {p} must be -1 or an earlier key of the zone")

    def depths(self) -> list[int]:
        out: list[int] = []
        for p in self.parents:
            out.append(0 if p < 0 else out[p] + 1)
        return out

    def ancestors(self) -> torch.Tensor:  # [Z, Z] bool: [j, i] = key i is key j or one of its ancestors
        z = len(self.parents)
        anc = torch.eye(z, dtype=torch.bool)
        for j, p in enumerate(self.parents):
            if p >= 0:
                anc[j] |= anc[p]
        return anc

    def positions(self, start: int, n: int) -> list[int]:
        """Positions of the n rows at keys start .. start + n - 1."""
        depth = self.depths()
        return [k if k < self.base else self.base + depth[k - self.base] for k in range(start, start + n)]


def tree_metadata(
    starts: list[int],  # [B] key index of each sequence's first new row
    lens: list[int],  # [B] new rows per sequence
    gather: torch.Tensor,  # [B, L] slot of every key index (L = max(start + len))
    trees: list[TreeSpec | None],  # [B] None: causal rows
    sliding_window: int | None = None,
) -> tuple[list[list[int]], AttentionMetadata]:
    """(positions per sequence, padded to T = max(lens) with 0; the metadata of the padded batch)."""
    B, L = gather.shape
    T = max(lens)
    mask = torch.zeros(B, T, L, dtype=torch.bool)
    keypos = torch.zeros(B, L, dtype=torch.long)  # each key's position (for the sliding window)
    pos_rows, slot_rows = [], []
    for b, (start, n, tree) in enumerate(zip(starts, lens, trees)):
        end = start + n
        keypos[b] = torch.arange(L)
        if tree is None or end <= tree.base:
            pos = list(range(start, end))
            for r in range(n):
                mask[b, r, : start + r + 1] = True
        else:
            if end > tree.base + len(tree.parents):
                raise ValueError(f"rows reach key {end - 1}, past the tree zone's last ({tree.base + len(tree.parents) - 1})")
            pos = tree.positions(start, n)
            anc = tree.ancestors()  # [Z, Z]
            depth = torch.tensor(tree.depths(), dtype=torch.long)
            zone = min(end, L) - tree.base
            keypos[b, tree.base : tree.base + zone] = tree.base + depth[:zone]
            for r in range(n):
                k = start + r
                if k < tree.base:
                    mask[b, r, : k + 1] = True
                else:
                    mask[b, r, : tree.base] = True
                    mask[b, r, tree.base : end] = anc[k - tree.base, : end - tree.base]
        mask[b, n:, 0] = True  # padding rows attend key 0 (their output is never read)
        pos_rows.append(pos + [0] * (T - n))
        slot_rows.append(gather[b, start:end].tolist() + [-1] * (T - n))
    positions = torch.tensor(pos_rows, dtype=torch.long)  # [B, T]
    if sliding_window is not None:
        mask &= keypos[:, None, :] > (positions[:, :, None] - sliding_window)
        mask[:, :, 0] |= ~mask.any(dim=-1)  # (a padding row keeps one key)
    flat = torch.tensor(slot_rows, dtype=torch.long).reshape(-1)
    write_index = torch.nonzero(flat >= 0).squeeze(1)
    meta = AttentionMetadata(write_index, flat[write_index], gather, mask.unsqueeze(1))
    return pos_rows, meta


def kernel_trees(trees: list[TreeSpec | None], seq_lens: list[int]) -> list[int] | None:
    """The fused kernels' tree argument (dw_attend_batch) for B sequences with seq_lens[b] keys each:
    B entries (-1: causal rows; else the offset of the sequence's record), then each record: its
    zone's base and the parents of keys base .. seq_lens[b] - 1. None: every sequence causal."""
    if all(t is None for t in trees):
        return None
    head, body = [], []
    for tree, n in zip(trees, seq_lens):
        if tree is None or n <= tree.base:
            head.append(-1)
            continue
        if n > tree.base + len(tree.parents):
            raise ValueError(f"keys reach {n - 1}, past the tree zone's last ({tree.base + len(tree.parents) - 1})")
        head.append(len(trees) + len(body))
        body += [tree.base, *tree.parents[: n - tree.base]]
    return head + body
