"""The rejection sampler of speculative decoding, as a pure function over tensors.

Glossary (one row b of the batch, p = target, q = draft):

- proposed: the draft's tokens x_0 .. x_{n-1}, n = num_draft[b] <= K; position j of the row
  is the position of x_j, and p_j, q_j are the target's and draft's distributions there.
- accepted: a proposal kept. x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j))
  (a point-mass draft, q = None: with probability p_j(x_j)); greedy rows accept x_j iff it is
  argmax p_j. Proposals after the first rejection are discarded.
- recovered: the token committed in place of the first rejected proposal x_j, drawn from the
  residual r_j = max(p_j - q_j, 0) / sum(max(p_j - q_j, 0)) (point mass: p_j with x_j zeroed,
  renormalised; greedy: argmax p_j). If the residual has no mass, p_j is used.
- bonus: the extra token drawn from p_n when all n proposals are accepted (n = 0: plain decoding).
- committed: accepted proposals followed by the one recovered or bonus token: 1 .. n+1 tokens.

Each committed token is distributed exactly as the target would sample it after the same
history (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling").
That guarantee needs p_j and q_j to be the final, processed distributions (see processors.py).

Randomness is separated from logic: `rejection_sample` draws uniforms, and
`rejection_sample_from_uniforms` is deterministic given them. Per row the draws are, in order,
one float64 uniform for the recovered/bonus draw and then one per proposal (n of them), so a row
with its own generator gets the same output whatever else is in the batch; greedy rows draw
nothing. A single generator for the batch draws one [B, K+1] block instead. Categorical draws use the inverse CDF in float64, exact in distribution up to float64
rounding. `accept_probability` and `residual_distribution` are the two formulas of the algorithm;
the exact tests compute branch probabilities with these same functions.
"""
from __future__ import annotations

from typing import Sequence

import torch

Generators = torch.Generator | Sequence[torch.Generator | None] | None


def accept_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) in float64; q(x) = 1 for a point-mass draft.

    q(x) = 0 cannot happen for a token the draft sampled; it is guarded as "accept iff p(x) > 0".
    """
    p_x = p_x.to(torch.float64)
    q_x = q_x.to(torch.float64)
    ratio = p_x / torch.where(q_x > 0, q_x, torch.ones_like(q_x))
    return torch.where(q_x > 0, ratio.clamp(max=1.0), (p_x > 0).to(torch.float64))


def residual_mass(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # [..., V] -> [..., V] float64
    """max(p - q, 0), unnormalised, falling back to p where it has no mass."""
    p = p.to(torch.float64)
    r = (p - q.to(torch.float64)).clamp_(min=0.0)
    empty = r.sum(dim=-1) <= 0
    if bool(empty.any()):
        r[empty] = p[empty]
    return r


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # [..., V] float64
    """The recovered token's distribution after a rejection: max(p - q, 0) normalised."""
    r = residual_mass(p, q)
    return r / r.sum(dim=-1, keepdim=True)


def categorical_from_uniform(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: [B, V] non-negative weights (any scale), [B] uniforms in [0, 1) -> [B] long.

    Token i is drawn iff cdf[i-1] <= u * total < cdf[i], so zero-weight tokens are never drawn.
    """
    cdf = torch.cumsum(weights.to(torch.float64), dim=-1)  # [B, V]
    total = cdf[:, -1:]  # [B, 1]
    idx = torch.searchsorted(cdf, u.to(torch.float64)[:, None] * total, right=True).squeeze(1)  # [B]
    # u * total can round up to total (idx = V); then take the last token with positive weight.
    vocab = weights.shape[-1]
    over = idx >= vocab  # [B]
    if bool(over.any()):
        w = weights[over]
        idx[over] = torch.where(w > 0, torch.arange(vocab, device=w.device), -1).amax(dim=-1)
    return idx


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, K] long (padding arbitrary beyond num_draft)
    draft_probs: torch.Tensor | None,  # [B, K, V] q; None = point mass on the draft token
    target_probs: torch.Tensor,  # [B, K+1, V] p; row n = num_draft[b] is the bonus distribution
    generator: Generators,
    *,
    num_draft: torch.Tensor | None = None,  # [B] long, 0..K
    is_greedy: torch.Tensor | None = None,  # [B] bool
) -> tuple[torch.Tensor, torch.Tensor]:  # committed [B, K+1] long, -1 padded; num_accepted [B] long
    """Verify a batch of proposals; see the module docstring for the glossary and guarantees.

    `generator` is one generator for the whole batch, or one per row (None = torch's default).
    """
    b, k = draft_token_ids.shape
    device = target_probs.device
    num_draft = _num_draft(num_draft, b, k, device)
    greedy = _greedy(is_greedy, b, device)
    u_recover, u_accept = _draw_uniforms(generator, num_draft, greedy, k, device)
    return rejection_sample_from_uniforms(
        draft_token_ids,
        draft_probs,
        target_probs,
        u_accept,
        u_recover,
        num_draft=num_draft,
        is_greedy=greedy,
    )


def rejection_sample_from_uniforms(
    draft_token_ids: torch.Tensor,  # [B, K] long
    draft_probs: torch.Tensor | None,  # [B, K, V] or None
    target_probs: torch.Tensor,  # [B, K+1, V]
    u_accept: torch.Tensor,  # [B, K] float64 in [0, 1): proposal j accepted iff u_accept[b, j] < accept prob
    u_recover: torch.Tensor,  # [B] float64 in [0, 1): inverse-CDF uniform of the recovered/bonus draw
    *,
    num_draft: torch.Tensor | None = None,  # [B] long
    is_greedy: torch.Tensor | None = None,  # [B] bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic core of `rejection_sample`: same inputs and outputs, uniforms given."""
    b, k = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    if target_probs.shape[:2] != (b, k + 1):
        raise ValueError(f"target_probs must be [B, K+1, V] = [{b}, {k + 1}, V], got {list(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != (b, k, vocab):
        raise ValueError(f"draft_probs must be [B, K, V] = [{b}, {k}, {vocab}], got {list(draft_probs.shape)}")
    num_draft = _num_draft(num_draft, b, k, device)
    greedy = _greedy(is_greedy, b, device)
    rows = torch.arange(b, device=device)
    pos = torch.arange(k, device=device)
    draft = draft_token_ids.to(device=device, dtype=torch.long)  # [B, K]
    proposed = pos[None, :] < num_draft[:, None]  # [B, K]
    draft_safe = torch.where(proposed, draft, 0).clamp(0, vocab - 1)  # [B, K], gatherable

    # Which proposals pass their test, before "stop at the first rejection".
    p_x = target_probs[:, :k].gather(-1, draft_safe[..., None]).squeeze(-1)  # [B, K]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, draft_safe[..., None]).squeeze(-1)  # [B, K]
    passes = u_accept.to(device=device, dtype=torch.float64) < accept_probability(p_x, q_x)  # [B, K]
    target_argmax = None
    if bool(greedy.any()):
        target_argmax = torch.zeros(b, k + 1, dtype=torch.long, device=device)  # [B, K+1]
        target_argmax[greedy] = target_probs[greedy].argmax(dim=-1)
        passes = torch.where(greedy[:, None], draft_safe == target_argmax[:, :k], passes)
    passes &= proposed
    num_accepted = passes.to(torch.long).cumprod(dim=-1).sum(dim=-1)  # [B]

    # One more token per row at position num_accepted: recovered if a proposal was rejected there,
    # bonus otherwise. Greedy rows take argmax p; random rows draw from the residual or from p.
    rejected = num_accepted < num_draft  # [B]
    last_token = torch.empty(b, dtype=torch.long, device=device)  # [B]
    if target_argmax is not None:
        last_token[greedy] = target_argmax[rows, num_accepted][greedy]
    rand = torch.nonzero(~greedy).squeeze(1)  # [R] random rows
    if rand.numel():
        last_token[rand] = _draw_last(rand, num_accepted[rand], rejected[rand], draft_safe, draft_probs,
                                      target_probs, u_recover.to(device)[rand])

    committed = torch.full((b, k + 1), -1, dtype=torch.long, device=device)  # [B, K+1]
    committed[:, :k] = torch.where(pos[None, :] < num_accepted[:, None], draft, -1)
    committed[rows, num_accepted] = last_token
    return committed, num_accepted


def _draw_last(rand, at, rej, draft_safe, draft_probs, target_probs, u) -> torch.Tensor:  # [R] long
    """The recovered (rows with a rejection at `at`) or bonus token of the random rows `rand`:
    drawn from max(p - q, 0) at the rejection (q a point mass when draft_probs is None), else p."""
    vocab = target_probs.shape[-1]
    weights = target_probs[rand, at].to(torch.float64)  # [R, V]
    if bool(rej.any()):
        rr, jr = rand[rej], at[rej]  # rows with a rejection, and its position
        if draft_probs is None:
            q_last = torch.zeros(rr.numel(), vocab, dtype=torch.float64, device=weights.device)
            q_last.scatter_(1, draft_safe[rr, jr][:, None], 1.0)
        else:
            q_last = draft_probs[rr, jr]  # [Rj, V]
        weights[rej] = residual_mass(target_probs[rr, jr], q_last)
    return categorical_from_uniform(weights, u)


def _num_draft(num_draft, b: int, k: int, device) -> torch.Tensor:  # [B] long
    if num_draft is None:
        return torch.full((b,), k, dtype=torch.long, device=device)
    n = num_draft.to(device=device, dtype=torch.long)
    if n.shape != (b,) or bool(((n < 0) | (n > k)).any()):
        raise ValueError(f"num_draft must be [B] = [{b}] with values in [0, {k}], got {n.tolist()}")
    return n


def _greedy(is_greedy, b: int, device) -> torch.Tensor:  # [B] bool
    if is_greedy is None:
        return torch.zeros(b, dtype=torch.bool, device=device)
    g = is_greedy.to(device=device, dtype=torch.bool)
    if g.shape != (b,):
        raise ValueError(f"is_greedy must be [B] = [{b}], got {list(g.shape)}")
    return g


def _draw_uniforms(generator: Generators, num_draft, greedy, k: int, device):
    """u_recover [B] and u_accept [B, K], float64 on `device`; padding positions get 1.0 (never used)."""
    b = num_draft.shape[0]
    if generator is None or isinstance(generator, torch.Generator):
        gen_device = generator.device if generator is not None else device
        u = torch.rand(b, k + 1, dtype=torch.float64, generator=generator, device=gen_device).to(device)
        return u[:, 0], u[:, 1:]
    if len(generator) != b:
        raise ValueError(f"generator: expected one generator per row ({b}), got {len(generator)}")
    u = torch.ones(b, k + 1, dtype=torch.float64)  # [B, K+1] on the CPU, filled row by row
    counts = num_draft.tolist()
    skip = greedy.tolist()
    for i, g in enumerate(generator):
        if skip[i]:
            continue
        gen_device = g.device if g is not None else torch.device(device)
        u[i, : counts[i] + 1] = torch.rand(counts[i] + 1, dtype=torch.float64, generator=g, device=gen_device).cpu()
    u = u.to(device)
    return u[:, 0], u[:, 1:]
