"""Logit processing: the one function that turns raw logits plus history into the final distribution.

`process_logits` applies a request's `SamplingParams` to one row of logits per position, in the
order vLLM uses:

0. the structured-output mask (`token_bitmask`, computed by the caller from the sequence's grammar
   state and the proposals before the row: sampling/grammar.py): disallowed tokens -> -inf;
1. `logit_bias` (added);
2. `min_tokens`: while the row's output is shorter than `min_tokens`, its `stop_token_ids` and
   (unless `ignore_eos`) its EOS ids are masked;
3. `repetition_penalty` over the prompt and output tokens (positive logits divided, negative
   multiplied, as in HF / vLLM); `presence_penalty` and `frequency_penalty` over the output tokens
   only (OpenAI: logit -= frequency * count + presence * [count > 0]);
4. temperature (greedy rows, temperature 0, are left unscaled);
5. top-k, top-p (the smallest set of most probable tokens whose cumulative probability reaches
   top_p; the top token is always kept; both keep ties with their cut-off value), min_p (tokens with
   probability below min_p times the largest probability are dropped).

Steps 4 and 5 are skipped for greedy rows: truncation never changes the argmax, and leaving the
row untruncated keeps its log-probabilities meaningful. The result is float32 logits with masked
tokens at -inf: `probs = probs_from_logits(out)`, `logprobs = out.log_softmax(-1)`.

Exactness contract. Speculative decoding reproduces the target's distribution only if the
distribution the rejection sampler is given for position j is exactly the one plain decoding
would sample from after the same history. The engine therefore calls this function identically
for the target (p) and for the draft (q) at every proposed position: for proposed position j of a
request, `output_ids` is the committed output followed by the proposed tokens before j. The
function is pure in (logits, params, prompt_ids, output_ids, eos_ids): no state, no randomness,
and each row's result depends only on that row's inputs.
"""
from __future__ import annotations

from itertools import chain
from typing import Sequence

import torch

from .grammar import allowed_from_bitmask
from .params import SamplingParams


def process_logits(
    logits: torch.Tensor,  # [N, V] float32
    params: Sequence[SamplingParams],  # [N]
    prompt_ids: Sequence[Sequence[int]],  # [N] token ids of each row's prompt
    output_ids: Sequence[Sequence[int]],  # [N] output so far (committed + proposed before this position)
    eos_ids: Sequence[Sequence[int]] | None = None,  # [N] EOS ids per row, masked by min_tokens
    token_bitmask: torch.Tensor | None = None,  # [N, ceil(V/32)] int32, bit set = allowed (-1 = all)
) -> torch.Tensor:  # [N, V] float32, -inf = masked
    n, vocab = logits.shape
    if not (len(params) == len(prompt_ids) == len(output_ids) == n):
        raise ValueError(
            f"process_logits: {n} logit rows but {len(params)} params, {len(prompt_ids)} prompts, "
            f"{len(output_ids)} outputs"
        )
    if eos_ids is not None and len(eos_ids) != n:
        raise ValueError(f"process_logits: {n} logit rows but {len(eos_ids)} eos_ids")
    device = logits.device
    out = logits.to(torch.float32, copy=True)  # [N, V]; never modify the caller's tensor

    if token_bitmask is not None:
        _apply_token_bitmask(out, token_bitmask)
    _apply_logit_bias(out, params)
    _apply_min_tokens(out, params, output_ids, eos_ids)
    _apply_penalties(out, params, prompt_ids, output_ids)

    sampled = [i for i, sp in enumerate(params) if not sp.is_greedy]
    if not sampled:
        return out
    rows = torch.tensor(sampled, device=device)  # [M]
    temps = torch.tensor([params[i].temperature for i in sampled], dtype=torch.float32, device=device)
    x = out if len(sampled) == n else out[rows]  # [M, V]
    if bool((temps != 1.0).any()):
        x = x / temps[:, None]
    x = _apply_top_k_top_p(x, [params[i] for i in sampled])
    x = _apply_min_p(x, [params[i] for i in sampled])
    if len(sampled) == n:
        return x
    out[rows] = x
    return out


def changes_logits(params: SamplingParams, num_output: int) -> bool:
    """Whether `process_logits` can change a row's logits (bias, penalties, the min_tokens mask;
    temperature, top-k/top-p and min-p for sampled rows) at a position whose output history holds
    at least num_output tokens. False: p (or q) is the raw logits, and a greedy row's token their
    argmax. (A grammar's bitmask is the caller's to check.)"""
    return (not params.is_greedy or bool(params.logit_bias) or params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or num_output < params.min_tokens)


def probs_from_logits(processed: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N, V]
    return torch.softmax(processed.to(torch.float32), dim=-1)


def _apply_token_bitmask(out: torch.Tensor, bitmask: torch.Tensor) -> None:
    if bitmask.shape[0] != out.shape[0]:
        raise ValueError(f"process_logits: {out.shape[0]} logit rows but {bitmask.shape[0]} bitmask rows")
    allowed = allowed_from_bitmask(bitmask, out.shape[1]).to(out.device)  # [N, V]; -1 rows: all True
    out.masked_fill_(~allowed, -torch.inf)


def _apply_logit_bias(out: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    rows, cols, vals = [], [], []
    for i, sp in enumerate(params):
        if sp.logit_bias:
            for tok, b in sp.logit_bias.items():
                rows.append(i)
                cols.append(tok)
                vals.append(b)
    if rows:
        idx = (torch.tensor(rows, device=out.device), torch.tensor(cols, device=out.device))
        out.index_put_(idx, torch.tensor(vals, dtype=out.dtype, device=out.device), accumulate=True)


def _apply_min_tokens(out, params, output_ids, eos_ids) -> None:
    rows, cols = [], []
    for i, sp in enumerate(params):
        if len(output_ids[i]) >= sp.min_tokens:
            continue
        stops = list(sp.stop_token_ids or [])
        if not sp.ignore_eos and eos_ids is not None:
            stops += list(eos_ids[i])
        rows += [i] * len(stops)
        cols += stops
    if rows:
        out[torch.tensor(rows, device=out.device), torch.tensor(cols, device=out.device)] = -torch.inf


def _token_counts(histories: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:  # [M, V]
    """Counts of each token id in each history, built with one scatter_add over a padded tensor."""
    m = len(histories)
    lengths = [len(h) for h in histories]
    width = max(lengths, default=0)
    counts = torch.zeros(m, vocab + 1, dtype=torch.float32, device=device)  # column V = padding
    if width == 0:
        return counts[:, :vocab]
    flat = torch.tensor(list(chain.from_iterable(map(list, histories))), dtype=torch.long)  # [sum L]
    lens = torch.tensor(lengths)  # [M]
    padded = torch.full((m, width), vocab, dtype=torch.long)  # [M, L]
    padded[torch.arange(width)[None, :] < lens[:, None]] = flat
    padded = padded.to(device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def _apply_penalties(out, params, prompt_ids, output_ids) -> None:
    vocab = out.shape[1]
    rep = [i for i, sp in enumerate(params) if sp.repetition_penalty != 1.0]
    pf = [i for i, sp in enumerate(params) if sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0]
    if rep:
        rows = torch.tensor(rep, device=out.device)
        seen = _token_counts([list(prompt_ids[i]) + list(output_ids[i]) for i in rep], vocab, out.device) > 0
        penalty = torch.tensor(
            [params[i].repetition_penalty for i in rep], dtype=out.dtype, device=out.device
        )[:, None]  # [M, 1]
        x = out[rows]  # [M, V]
        penalised = torch.where(x > 0, x / penalty, x * penalty)
        out[rows] = torch.where(seen, penalised, x)
    if pf:
        rows = torch.tensor(pf, device=out.device)
        counts = _token_counts([output_ids[i] for i in pf], vocab, out.device)  # [M, V]
        freq = torch.tensor([params[i].frequency_penalty for i in pf], dtype=out.dtype, device=out.device)
        pres = torch.tensor([params[i].presence_penalty for i in pf], dtype=out.dtype, device=out.device)
        delta = freq[:, None] * counts + pres[:, None] * (counts > 0).to(out.dtype)  # [M, V]
        out[rows] = out[rows] - delta


def _apply_top_k_top_p(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p, as value thresholds: ties with the cut-off value are kept, so the
    result does not depend on how a sort orders equal logits."""
    m, vocab = x.shape
    ks = [sp.top_k if 0 < sp.top_k < vocab else vocab for sp in params]
    ps = [sp.top_p for sp in params]
    use_k = any(k < vocab for k in ks)
    use_p = any(p < 1.0 for p in ps)
    if not (use_k or use_p):
        return x
    width = max(ks)
    if width < vocab:  # every row is top-k limited: the largest k values suffice
        vals = torch.topk(x, width, dim=-1).values  # [M, W] descending
    else:
        vals = torch.sort(x, dim=-1, descending=True).values  # [M, V]
    if use_k:
        k = torch.tensor(ks, device=x.device)  # [M]
        kth = vals.gather(1, (k - 1)[:, None])  # [M, 1]
        x = x.masked_fill(x < kth, -torch.inf)
        vals = vals.masked_fill(vals < kth, -torch.inf)
    if use_p:
        top_p = torch.tensor(ps, dtype=torch.float64, device=x.device)[:, None]  # [M, 1]
        lse = torch.logsumexp(x.to(torch.float64), dim=-1, keepdim=True)  # [M, 1] over the kept set
        probs = torch.exp(vals.to(torch.float64) - lse)  # [M, W] descending
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        # The smallest prefix reaching top_p ends at the last token whose mass above is < top_p
        # (at least the top token).
        count = (before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)  # [M, 1]
        cutoff = vals.gather(1, count - 1)  # [M, 1]
        cutoff = torch.where(top_p < 1.0, cutoff, torch.full_like(cutoff, -torch.inf))
        x = x.masked_fill(x < cutoff, -torch.inf)
    return x


def _apply_min_p(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    if not any(sp.min_p > 0.0 for sp in params):
        return x
    min_p = torch.tensor([sp.min_p for sp in params], dtype=torch.float32, device=x.device)[:, None]
    probs = torch.softmax(x, dim=-1)  # [M, V]
    threshold = probs.max(dim=-1, keepdim=True).values * min_p  # [M, 1]; min_p 0 keeps everything
    return x.masked_fill(probs < threshold, -torch.inf)
