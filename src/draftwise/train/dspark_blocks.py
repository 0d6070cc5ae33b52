"""The blocks a DSpark drafter trains and is evaluated on: anchors drawn along corpus windows, the
true tokens and the target's distributions after each, and the one pass of each model over them."""
from __future__ import annotations

import torch

from ..model.dspark import DSparkDrafter


def sample_anchors(B: int, T: int, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, N] sorted anchors in 1..T-2, drawn without replacement (N = min(n, T-2)): each block has a
    context before it and at least one label after it."""
    n = min(n, T - 2)
    keys = torch.rand(B, T - 2, generator=generator)
    return keys.argsort(dim=1)[:, :n].sort(dim=1).values + 1


def block_targets(ids: torch.Tensor, anchors: torch.Tensor, gamma: int):
    """ids [B, T], anchors [B, N] -> labels, prev_ids, p_rows [B, N, gamma] and valid [B, N, gamma]:
    x_{a+k}, x_{a+k-1} (the anchor first), the row a+k-1 whose target distribution is p_k, and
    whether a+k lies inside the window (clamped indices where it does not)."""
    T = ids.shape[1]
    idx = anchors[..., None] + torch.arange(1, gamma + 1)  # [B, N, gamma]
    valid = idx < T
    idx = idx.clamp(max=T - 1)
    take = lambda i: ids.gather(1, i.flatten(1)).view(i.shape)  # noqa: E731
    return take(idx), take(idx - 1), idx - 1, valid


def position_weights(valid: torch.Tensor, decay: float) -> torch.Tensor:
    """exp(-(k-1)/decay) on the positions inside the window, 0 elsewhere: [B, N, gamma]."""
    k = torch.arange(valid.shape[-1], dtype=torch.float32)
    return valid.float() * torch.exp(-k / decay)


def kept_alphabet(p_all: torch.Tensor, kept: torch.Tensor):
    """p [..., V] -> p over the `kept` tokens and one more entry, the rest of the vocabulary
    [..., N + 1]; and the map from token ids to that alphabet (-1 outside it). A drafter over the kept
    tokens gives the rest no mass, so TV over this alphabet is TV over the whole vocabulary."""
    p = p_all[..., kept]
    p = torch.cat((p, (1.0 - p.sum(-1, keepdim=True)).clamp_min(0.0)), -1)
    index = torch.full((p_all.shape[-1],), -1, dtype=torch.long)
    index[kept] = torch.arange(len(kept))
    return p, index


def block_forward(drafter: DSparkDrafter, target, ids: torch.Tensor, anchors: torch.Tensor,
                  first_anchors: torch.Tensor | None = None, kept: torch.Tensor | None = None):
    """The target's one pass and the drafter's one pass over a batch: ids [B, T], anchors [B, N] ->
    q logits [B, N, gamma, V], p [B, N, gamma, V], confidence logits, labels, valid [B, N, gamma].
    With `first_anchors` [B, N1] (a causal block's drafter only) also the same five for blocks of
    their first row alone at those anchors ([B, N1, 1, ...]), from the same passes: a tuple of two.
    With `kept` [N] (a drafter whose head gives those tokens' logits, training `--draft-vocab`):
    q and p over `kept_alphabet` ([..., N + 1], q's last logit -inf), labels -1 outside the kept."""
    cfg = drafter.cfg
    B, T = ids.shape
    with torch.no_grad():
        hidden, feats = target(ids, feature_layers=tuple(cfg.target_feature_layers))
        p_all = torch.softmax(target.compute_logits(hidden).float(), -1)  # [B, T, V]: the head once per position
        index = None
        if kept is not None:
            p_all, index = kept_alphabet(p_all, kept)
    pos = torch.arange(T).expand(B, T)
    fused = drafter.fuse(feats.detach())  # [B, T, H]
    kv = drafter.context_kv(fused, pos)

    def blocks(a: torch.Tensor, rows: int):
        labels, prev, p_rows, valid = block_targets(ids, a, rows)
        p = p_all.gather(1, p_rows.flatten(1)[..., None].expand(-1, -1, p_all.shape[-1])).view(*p_rows.shape, -1)
        last = fused.gather(1, (a - 1)[..., None].expand(-1, -1, fused.shape[-1]))  # [B, N, H]: a - 1
        h = drafter.block_hidden(ids.gather(1, a), a, kv, pos, last, rows=rows)  # [B, N, rows, H]
        q_logits, conf = drafter.teacher_forced(h, prev)
        if index is not None:
            rest = torch.full((*q_logits.shape[:-1], 1), float("-inf"), dtype=q_logits.dtype)
            q_logits, labels = torch.cat((q_logits, rest), -1), index[labels]
        return q_logits, p, conf, labels, valid

    out = blocks(anchors, cfg.block_size)
    return out if first_anchors is None else (out, blocks(first_anchors, 1))
