"""`verify`: the selection rule over a whole ragged batch, as one pure function.

    committed, num_accepted = verify(p_logits, meta, q, generators)

In:
- `p_logits` `[N, V]`: the target's *processed* logits (`process_logits`), flat: sequence b owns
  rows `cu_num_logits[b] : cu_num_logits[b+1]`, one per proposal plus the bonus row last
  (`1 + num_draft[b]` rows; a row without proposals is plain decoding);
- `meta` (`VerifyMetadata`): the batch's shape, built by hand in tests or with `build`;
- `q` `[sum(num_draft), V]` or None: the drafter's processed distribution at every proposal, flat
  in the same order (None: every proposal is a point mass, e.g. n-gram lookup); rows of greedy
  sequences are never read;
- `generators`: one per sequence (None = torch's default), or one for the whole batch, as in
  `rejection_sample`; or, instead, `draws` = (u_accept `[B, K]`, u_recover `[B]`): the uniforms
  themselves (the exact tests steer each branch with them).
- `num_draft` in the metadata must depend only on what a causal rule may see (committed history,
  earlier proposals, q): whether a proposal is verified never depends on the proposal itself.

Out (`VerifyResult`): `committed` `[B, K+1]` (-1 = nothing), `num_accepted` `[B]`, and `valid`
`[B]`: False where the row's distribution is unusable (NaN logits, or every token masked) or a
drawn id falls outside the vocabulary; such a row commits nothing, and the caller fails that
sequence alone.

Greedy rows are decided here on the argmax of p's logits (no softmax: the argmax of the processed
logits is the argmax of p); the other rows go through `rejection_sample`, whose glossary and
guarantees (rejection.py) hold row by row. Nothing here depends on which drafter proposed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .rejection import Generators, rejection_sample, rejection_sample_from_uniforms


@dataclass
class VerifyMetadata:
    """The flat description of one verification over a ragged batch of B sequences."""

    num_draft: torch.Tensor  # [B] long: proposals verified by each sequence (0 = plain decoding)
    cu_num_logits: torch.Tensor  # [B+1] long: cumulative (1 + num_draft), offsets into p_logits
    cu_num_draft: torch.Tensor  # [B+1] long: cumulative num_draft, offsets into q
    draft_token_ids: torch.Tensor  # [B, K] long, padded with -1
    is_greedy: torch.Tensor  # [B] bool

    @staticmethod
    def build(draft_token_ids: Sequence[Sequence[int]], is_greedy: Sequence[bool]) -> "VerifyMetadata":
        num_draft = torch.tensor([len(d) for d in draft_token_ids], dtype=torch.long)  # [B]
        b, k = len(draft_token_ids), int(num_draft.max()) if len(draft_token_ids) else 0
        ids = torch.full((b, k), -1, dtype=torch.long)  # [B, K]
        if k:
            ids[torch.arange(k)[None, :] < num_draft[:, None]] = torch.tensor(
                [t for d in draft_token_ids for t in d], dtype=torch.long)
        zero = torch.zeros(1, dtype=torch.long)
        return VerifyMetadata(
            num_draft=num_draft,
            cu_num_logits=torch.cat([zero, torch.cumsum(num_draft + 1, 0)]),
            cu_num_draft=torch.cat([zero, torch.cumsum(num_draft, 0)]),
            draft_token_ids=ids,
            is_greedy=torch.as_tensor(list(is_greedy), dtype=torch.bool).reshape(b),
        )

    @property
    def batch_size(self) -> int:
        return self.draft_token_ids.shape[0]

    @property
    def max_k(self) -> int:
        return self.draft_token_ids.shape[1]

    def logits_index(self) -> torch.Tensor:  # [B, K+1] long
        """Flat p_logits row of position j of sequence b; positions past the bonus repeat it."""
        j = torch.arange(self.max_k + 1)[None, :]
        return self.cu_num_logits[:-1, None] + torch.minimum(j, self.num_draft[:, None])

    def draft_index(self) -> torch.Tensor:  # [B, K] long
        """Flat q row of proposal j of sequence b (clamped into the row's range; padding unread)."""
        j = torch.arange(self.max_k)[None, :]
        last = (self.num_draft - 1).clamp(min=0)[:, None]
        total = int(self.cu_num_draft[-1])
        return (self.cu_num_draft[:-1, None] + torch.minimum(j, last)).clamp(max=max(total - 1, 0))


@dataclass
class VerifyResult:
    committed: torch.Tensor  # [B, K+1] long, -1 padded: accepted proposals, then recovered or bonus
    num_accepted: torch.Tensor  # [B] long
    valid: torch.Tensor  # [B] bool: False = unusable distribution, nothing committed

    def tokens(self, b: int) -> list[int]:
        """Committed tokens of sequence b (empty when it is not valid)."""
        return self.committed[b, : int(self.num_accepted[b]) + 1].tolist() if bool(self.valid[b]) else []


def verify(
    p_logits: torch.Tensor,  # [N, V] processed target logits, N = sum(1 + num_draft)
    meta: VerifyMetadata,
    q: torch.Tensor | None,  # [sum(num_draft), V] processed draft probabilities, or None (point mass)
    generators: Generators = None,  # [B] generators, or one for the batch
    draws: tuple[torch.Tensor, torch.Tensor] | None = None,  # (u_accept [B, K], u_recover [B]) float64
) -> VerifyResult:
    b, k = meta.batch_size, meta.max_k
    vocab = p_logits.shape[-1]
    if p_logits.shape[0] != int(meta.cu_num_logits[-1]):
        raise ValueError(f"p_logits has {p_logits.shape[0]} rows, the metadata describes {int(meta.cu_num_logits[-1])}")
    idx = meta.logits_index()  # [B, K+1]
    # A row is usable if no logit is NaN and some token is not masked.
    usable_rows = ~torch.isnan(p_logits).any(-1) & (p_logits > -torch.inf).any(-1)  # [N]
    valid = usable_rows[idx].all(-1)  # [B]
    committed = torch.full((b, k + 1), -1, dtype=torch.long)
    num_accepted = torch.zeros(b, dtype=torch.long)
    draft = meta.draft_token_ids
    pos = torch.arange(k)[None, :]

    greedy = torch.nonzero(meta.is_greedy & valid).squeeze(1)  # [G]
    if greedy.numel():
        argmax = p_logits.argmax(-1)[idx[greedy]]  # [G, K+1]
        proposed = pos < meta.num_draft[greedy, None]  # [G, K]
        passes = (draft[greedy] == argmax[:, :k]) & proposed
        acc = passes.to(torch.long).cumprod(-1).sum(-1)  # [G]
        row = torch.where(pos < acc[:, None], draft[greedy], -1)  # [G, K]
        committed[greedy] = torch.cat([row, torch.full((len(greedy), 1), -1, dtype=torch.long)], 1)
        committed[greedy, acc] = argmax.gather(1, acc[:, None]).squeeze(1)
        num_accepted[greedy] = acc

    rand = torch.nonzero(~meta.is_greedy & valid).squeeze(1)  # [R]
    if rand.numel():
        p = torch.softmax(p_logits[idx[rand]], dim=-1)  # [R, K+1, V]
        q_rows = None
        if q is not None and k and q.shape[0]:
            q_rows = q[meta.draft_index()[rand]]  # [R, K, V]
        if draws is not None:
            c, a = rejection_sample_from_uniforms(draft[rand], q_rows, p, draws[0][rand], draws[1][rand],
                                                  num_draft=meta.num_draft[rand])
        else:
            gens = generators
            if generators is not None and not isinstance(generators, torch.Generator):
                gens = [generators[i] for i in rand.tolist()]
            c, a = rejection_sample(draft[rand], q_rows, p, gens, num_draft=meta.num_draft[rand])
        committed[rand], num_accepted[rand] = c, a

    # the sampler must never emit an id outside the vocabulary: a row that would is failed alone
    kept = torch.arange(k + 1)[None, :] <= num_accepted[:, None]  # [B, K+1]
    out_of_vocab = (kept & ((committed < 0) | (committed >= vocab))).any(-1)  # [B]
    valid = valid & ~out_of_vocab
    committed[~valid] = -1
    num_accepted[~valid] = 0
    return VerifyResult(committed, num_accepted, valid)


def flat_draft_probs(
    draft_token_ids: Sequence[Sequence[int]],  # [B] proposals of each sequence
    probs: Sequence[torch.Tensor | None],  # [B] q of each sequence ([num_draft_b, V]) or None
    vocab: int,
) -> torch.Tensor | None:  # [sum(num_draft), V] or None
    """Concatenate per-sequence q into the flat layout `verify` reads. None when no sequence has
    q (every proposal a point mass); a sequence without q among others gets point-mass rows."""
    if all(p is None for p in probs):
        return None
    rows = []
    for ids, p in zip(draft_token_ids, probs):
        if p is None and ids:
            p = torch.zeros(len(ids), vocab)
            p[torch.arange(len(ids)), torch.tensor(ids)] = 1.0
        if p is not None and len(ids):
            rows.append(p.to(torch.float32))
    return torch.cat(rows) if rows else None
