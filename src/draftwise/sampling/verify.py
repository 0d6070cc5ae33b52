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

import math

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
    # One pass over p's logits: each row's argmax (the greedy token) and its maximum, which is NaN
    # when any logit is NaN (max propagates NaN) and -inf when every token is masked.
    top, argmax = p_logits.max(dim=-1)  # [N], [N]
    usable = (~torch.isnan(top) & (top > -torch.inf)).tolist()  # [N]
    cu = meta.cu_num_logits.tolist()  # [B+1]
    valid = [all(usable[cu[i] : cu[i + 1]]) for i in range(b)]  # [B]
    greedy = meta.is_greedy.tolist()  # [B]
    drafts = meta.draft_token_ids.tolist()  # [B][K]
    num_draft = meta.num_draft.tolist()  # [B]
    rows = [[-1] * (k + 1) for _ in range(b)]  # committed, -1 padded
    accepted = [0] * b
    if any(g and v for g, v in zip(greedy, valid)):  # greedy rows: on ints, no softmax
        am = argmax.tolist()
        for i in range(b):
            if greedy[i] and valid[i]:
                a, base = 0, cu[i]
                while a < num_draft[i] and drafts[i][a] == am[base + a]:
                    a += 1
                rows[i][:a] = drafts[i][:a]
                rows[i][a] = am[base + a]
                accepted[i] = a
    rand = [i for i in range(b) if not greedy[i] and valid[i]]  # [R]
    if rand:
        c, a = _sample_rows(p_logits, meta, q, generators, draws, torch.tensor(rand))
        for r, i in enumerate(rand):
            rows[i], accepted[i] = c[r], a[r]
    # the sampler must never emit an id outside the vocabulary: a row that would is failed alone
    for i in range(b):
        if valid[i] and any(not 0 <= t < vocab for t in rows[i][: accepted[i] + 1]):
            valid[i] = False
        if not valid[i]:
            rows[i], accepted[i] = [-1] * (k + 1), 0
    committed = torch.tensor(rows, dtype=torch.long).reshape(b, k + 1)
    num_accepted = torch.tensor(accepted, dtype=torch.long)
    valid = torch.tensor(valid, dtype=torch.bool)
    return VerifyResult(committed, num_accepted, valid)


def verify_argmax(
    logits: torch.Tensor,  # [N, V] float32 target logits that no processor changes, N = sum(1 + num_draft)
    draft_token_ids: Sequence[Sequence[int]],  # [B][num_draft_b]
) -> tuple[list[list[int]], list[int], list[bool]]:  # committed tokens, accepted, valid: per row
    """The greedy selection rule for rows whose p is the argmax of the raw logits (temperature 0
    and no logits processor: no bias, penalty, min_tokens mask or grammar): keep proposals while
    they equal the argmax, then the argmax. `verify` decides the same for such rows (the same max
    over the same float32 values); this one skips its metadata tensors, one max and lists (a
    decode step at batch 1 is ~3 ms: the tensors were ~0.1 ms of it). A row whose logits hold a
    NaN or are all -inf commits nothing (valid False)."""
    want = sum(1 + len(d) for d in draft_token_ids)
    if logits.shape[0] != want:
        raise ValueError(f"logits has {logits.shape[0]} rows, the drafts describe {want}")
    # numpy's argmax: the first maximum as torch.max's, the first NaN where a row has one (NaN
    # compares as the largest); 2 us against torch.max's 13 for one 8192-token row (233 / 23 us
    # for 5 rows of 49152), which forks torch's thread team for a few microseconds of work
    a = logits.detach().float().cpu().numpy()
    am = a.argmax(axis=-1).tolist()  # [N]
    usable = [float(a[i, j]) > -math.inf for i, j in enumerate(am)]  # False: NaN, or every logit -inf
    tokens, accepted, valid = [], [], []
    base = 0
    for d in draft_token_ids:
        n = len(d)
        ok = all(usable[base : base + n + 1])
        a = 0
        if ok:
            while a < n and d[a] == am[base + a]:
                a += 1
        tokens.append(list(d[:a]) + [am[base + a]] if ok else [])
        accepted.append(a)
        valid.append(ok)
        base += n + 1
    return tokens, accepted, valid


def _sample_rows(p_logits, meta: VerifyMetadata, q, generators, draws, rand: torch.Tensor):
    """The rejection sampler over the random rows `rand` ([R]): (committed [R][K+1], accepted [R]) as lists."""
    k = meta.max_k
    draft = meta.draft_token_ids
    p = torch.softmax(p_logits[meta.logits_index()[rand]], dim=-1)  # [R, K+1, V]
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
    return c.tolist(), a.tolist()


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
