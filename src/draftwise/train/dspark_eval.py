"""Per-position acceptance on held-out text: a DSpark drafter's blocks, or a separate draft model's
proposals at the same positions, against the target.

At block position k (after anchor a, the true tokens before it) the acceptance of a draw from q_k
is c*_k = 1 - TV(q_k, p_k) (the rejection sampler's; DSpark's Figure 2 reads it the same way); the
greedy agreement is argmax q_k = argmax p_k. Teacher-forced: position k assumes x_1..x_{k-1} were
accepted, so the expected number accepted from a block is sum_k prod_{i<=k} c*_i, averaged over
blocks that lie inside their window. Anchors come from a seeded generator: both drafters are read
at the same positions.
"""
from __future__ import annotations

import torch

from .dspark_blocks import block_forward, block_targets, sample_anchors


def acceptance_summary(c_star: torch.Tensor, agree: torch.Tensor, valid: torch.Tensor) -> dict:
    """c_star, agree, valid [B, N, gamma] -> per-position means and the expected accepted length."""
    v = valid.float()
    per_pos = (c_star * v).sum((0, 1)) / v.sum((0, 1)).clamp_min(1)
    greedy = (agree.float() * v).sum((0, 1)) / v.sum((0, 1)).clamp_min(1)
    whole = valid.all(-1)  # blocks inside their window
    survival = c_star[whole].cumprod(-1).mean(0) if whole.any() else torch.zeros(c_star.shape[-1])
    greedy_run = agree[whole].long().cumprod(-1).float().mean(0) if whole.any() else torch.zeros(c_star.shape[-1])
    return {"per_position": [round(float(x), 4) for x in per_pos],
            "greedy_per_position": [round(float(x), 4) for x in greedy],
            "survival": [round(float(x), 4) for x in survival],  # P(x_1..x_k all accepted), sampled
            "expected_accepted": round(float(survival.sum()), 4),
            "greedy_accepted": round(float(greedy_run.sum()), 4), "blocks": int(whole.sum())}


def eval_anchors(windows: torch.Tensor, anchors: int, g: torch.Generator) -> list[torch.Tensor]:
    return [sample_anchors(w.shape[0], w.shape[1], anchors, g) for w in windows.split(2)]


@torch.no_grad()
def block_acceptance(drafter, target, windows: torch.Tensor, anchors: int, seed: int = 0) -> dict:
    """A DSpark drafter on windows [N, T]."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for w, a in zip(windows.split(2), eval_anchors(windows, anchors, g)):
        q_logits, p, _, _, valid = block_forward(drafter, target, w, a)
        q = torch.softmax(q_logits.float(), -1)
        parts.append((1 - 0.5 * (q - p).abs().sum(-1), q.argmax(-1) == p.argmax(-1), valid))
    return acceptance_summary(*(torch.cat(x, 0) for x in zip(*parts)))


@torch.no_grad()
def draft_acceptance(draft, target, windows: torch.Tensor, anchors: int, gamma: int, seed: int = 0) -> dict:
    """A separate draft model (`LlamaModel`, same vocabulary) at the same blocks' positions."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for w, a in zip(windows.split(2), eval_anchors(windows, anchors, g)):
        _, _, rows, valid = block_targets(w, a, gamma)
        flat = rows.flatten(1)[..., None]
        pick = lambda logits: torch.softmax(logits.float(), -1).gather(  # noqa: E731
            1, flat.expand(-1, -1, logits.shape[-1])).view(*rows.shape, -1)
        q, p = pick(draft.logits(w)), pick(target.logits(w))
        parts.append((1 - 0.5 * (q - p).abs().sum(-1), q.argmax(-1) == p.argmax(-1), valid))
    return acceptance_summary(*(torch.cat(x, 0) for x in zip(*parts)))
