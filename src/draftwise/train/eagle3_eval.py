"""Per-position acceptance of an EAGLE-3 drafter on held-out text, at the blocks (anchors) the DSpark
evaluation reads (train/dspark_eval.py), so the three drafters compare position by position.

A block at anchor a (its context x_0..x_a, the target's features of positions 0..a-1) is EAGLE-3's
round after that context: step k predicts x_{a+k} from the row of position a-1 (`unroll`'s row
t = a-1), teacher-forced on the window's tokens; p_k is the target's distribution after row
a+k-1. c*_k = 1 - TV(q_k, p_k) and the greedy agreement argmax q_k = argmax p_k, summarised as
`acceptance_summary` does.
"""
from __future__ import annotations

import torch

from .dspark_blocks import block_targets
from .dspark_eval import acceptance_summary, eval_anchors


@torch.no_grad()
def eagle3_acceptance(drafter, target, windows: torch.Tensor, anchors: int, steps: int, seed: int = 0) -> dict:
    """An EAGLE-3 drafter on windows [N, T], `steps` draft steps per block."""
    g = torch.Generator().manual_seed(seed)
    layers = tuple(drafter.cfg.target_feature_layers)
    parts = []
    for w, a in zip(windows.split(2), eval_anchors(windows, anchors, g)):
        hidden, feats = target(w, feature_layers=layers)
        p_all = torch.softmax(target.compute_logits(hidden).float(), -1)  # [B, T, V]
        _, _, rows, valid = block_targets(w, a, steps)  # rows [B, N, k]: a + k - 1
        out = drafter.unroll(feats, w, steps)  # [steps] of [B, T-1, V]
        t = (a - 1)[..., None].expand(-1, -1, out[0].shape[-1])  # [B, N, V]
        q = torch.stack([torch.softmax(o.float(), -1).gather(1, t) for o in out], 2)  # [B, N, k, V]
        V = p_all.shape[-1]
        p = p_all.gather(1, rows.flatten(1)[..., None].expand(-1, -1, V)).view(*rows.shape, V)
        parts.append((1 - 0.5 * (q - p).abs().sum(-1), q.argmax(-1) == p.argmax(-1), valid))
    return acceptance_summary(*(torch.cat(x, 0) for x in zip(*parts)))
