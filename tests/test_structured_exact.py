"""Structured output's exact tiers: speculation under a grammar mask (q masked like p), with and
without the grammar's forced tail beyond the draft, reproduces the masked target's distribution
by enumeration (TV <= 1e-9); forced tokens are the single legal ones.
"""

import pytest
import torch

from draftwise import SamplingParams
from draftwise.proposers import DraftBlock
from draftwise.sampling import process_logits
from draftwise.sampling.grammar import GrammarState


# ------------------------------------------------------------------ exact tier: enumeration
EXACT_VOCAB = ["a", "b", "c", "d", "<eos>"]
EXACT_REGEX = "ab[abcd]+|b(a|d)(a|b)+|c(c|d)[ad]+"  # masks depend on history; "ab" forces "b"


def _exact_logits(salt: int, history: tuple) -> torch.Tensor:  # [V] a stand-in for a model
    seed = salt
    for t in history:
        seed = seed * 31 + t + 1
    return torch.randn(len(EXACT_VOCAB), generator=torch.Generator().manual_seed(seed % 2**61))


def test_masked_speculation_reproduces_the_masked_target_exactly():
    """Every draft path x_1..x_n (q masked like p), every acceptance branch and final token,
    through `verify` with the uniforms of that branch: the distribution of the first n+1
    committed tokens equals the masked target's (TV <= 1e-9)."""
    import itertools

    import xgrammar as xgr

    from draftwise.sampling import VerifyMetadata, accept_probability, residual_distribution, verify

    V, n = len(EXACT_VOCAB), 2
    info = xgr.TokenizerInfo(EXACT_VOCAB, stop_token_ids=[4])
    compiled = xgr.GrammarCompiler(info).compile_regex(EXACT_REGEX)
    sp = SamplingParams(temperature=0.8)

    def dist(salt, history, bitmask_row):  # float64 probabilities of the processed logits
        out = process_logits(_exact_logits(salt, history)[None], [sp], [[0]], [list(history)],
                             token_bitmask=bitmask_row[None])
        return out, torch.softmax(out[0].double(), -1)

    def reference(history):  # the masked target from a fresh matcher fed the history
        g = GrammarState(compiled, V)
        for t in history:
            g.accept(t)
        return dist(1, history, g.verify_bitmask([])[0])[1]

    acc = {}
    root = GrammarState(compiled, V)
    for x in itertools.product(range(V), repeat=n):
        masks = root.verify_bitmask(list(x))  # [n+1, W]: the engine's masks for this block
        qs = [dist(2, x[:j], masks[j])[1] for j in range(n)]
        w_path = float(torch.prod(torch.stack([qs[j][x[j]] for j in range(n)])))
        if w_path == 0:
            continue
        p_rows = [dist(1, x[:j], masks[j]) for j in range(n + 1)]
        ps = [r[1] for r in p_rows]
        p_logits = torch.cat([r[0] for r in p_rows])  # [n+1, V]
        a = [float(accept_probability(ps[j][x[j]], qs[j][x[j]])) for j in range(n)]
        for k in range(n + 1):
            w = w_path * float(torch.prod(torch.tensor(a[:k], dtype=torch.float64))) * ((1 - a[k]) if k < n else 1.0)
            if w == 0:
                continue
            last = residual_distribution(ps[k], qs[k]) if k < n else ps[n]
            cdf = torch.cumsum(last, 0)
            for t in range(V):
                if last[t] == 0:
                    continue
                u_acc = torch.tensor([[0.0] * k + ([(a[k] + 1) / 2] if k < n else []) + [0.5] * (n - k - 1)],
                                     dtype=torch.float64)[:, :n]
                u_rec = torch.tensor([((cdf[t - 1] if t else 0.0) + cdf[t]) / 2], dtype=torch.float64)
                res = verify(p_logits, VerifyMetadata.build([list(x)], [False]), torch.stack(qs).float(),
                             draws=(u_acc, u_rec))
                got = tuple(res.tokens(0))
                assert got == x[:k] + (t,), (x, k, t, got)
                acc[got] = acc.get(got, 0.0) + w * float(last[t])
    # extend every committed prefix to n+1 tokens with the masked target, and compare
    full = {}
    for y, w in acc.items():
        stack = [(y, w)]
        while stack:
            h, wh = stack.pop()
            if len(h) == n + 1:
                full[h] = full.get(h, 0.0) + wh
                continue
            p = reference(h)
            stack += [(h + (t,), wh * float(p[t])) for t in range(V) if p[t] > 0]
    want = {}
    for y in itertools.product(range(V), repeat=n + 1):
        pr = 1.0
        for i in range(n + 1):
            pr *= float(reference(y[:i])[y[i]])
            if pr == 0:
                break
        if pr > 0:
            want[y] = pr
    assert abs(sum(full.values()) - 1.0) < 1e-9
    assert all(y[1] == 1 for y in want if y[0] == 0)  # "a" forces "b": the mask follows the history
    tv = 0.5 * sum(abs(full.get(y, 0.0) - want.get(y, 0.0)) for y in set(full) | set(want))
    assert tv <= 1e-9, tv



def test_forced_tokens_are_the_single_legal_ones():
    import xgrammar as xgr

    info = xgr.TokenizerInfo(EXACT_VOCAB, stop_token_ids=[4])
    g = GrammarState(xgr.GrammarCompiler(info).compile_regex("ab[cd]|ba"), len(EXACT_VOCAB))
    cur = g.cursor()
    assert cur.forced_tokens(8) == []  # "a" or "b"
    assert cur.accept(0) and cur.forced_tokens(8) == [1]  # "a" -> "b", then "c" or "d"
    assert cur.accept(1) and cur.accept(2) and cur.forced_tokens(8) == [4]  # only EOS is left
    fresh = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex("ab[cd]|ba"))
    assert not g.matcher.is_terminated() and g.matcher.accept_token(1) and fresh.accept_token(1)  # g untouched




FORCED_REGEX = "abc[ad]+|b(a|d)cd[ab]+|d[abc]"  # "a" forces "bc", "ba"/"bd" force "cd", "d?" forces EOS


@pytest.mark.parametrize("corrupt", [False, True])
def test_forced_tail_beyond_the_draft_reproduces_the_masked_target_exactly(corrupt):
    """Blocks of 2 drafted tokens (q masked like p) followed by the grammar's forced tail (up to 2
    more, q a point mass: `forced_tail` + `DraftBlock.extended`, as the engine builds them), every
    acceptance branch through `verify`: the first committed tokens are distributed exactly as the
    masked target's (TV <= 1e-9). corrupt: the tail's first token replaced by a wrong one (a bug
    that proposes an illegal "forced" token): p gives it 0, it is rejected, and exactness holds."""
    import itertools

    import xgrammar as xgr

    from draftwise.sampling import VerifyMetadata, accept_probability, residual_distribution, verify
    from draftwise.sampling.grammar import forced_tail

    V, n, limit = len(EXACT_VOCAB), 2, 2
    horizon = n + limit + 1
    info = xgr.TokenizerInfo(EXACT_VOCAB, stop_token_ids=[4])
    compiled = xgr.GrammarCompiler(info).compile_regex(FORCED_REGEX)
    sp = SamplingParams(temperature=0.8)
    memo = {}

    def dist(salt, history, bitmask_row):  # float64 probabilities of the processed logits
        out = process_logits(_exact_logits(salt, history)[None], [sp], [[0]], [list(history)],
                             token_bitmask=bitmask_row[None])
        return out, torch.softmax(out[0].double(), -1)

    def reference(history):  # the masked target from a fresh matcher fed the history
        if history not in memo:
            g = GrammarState(compiled, V)
            done = any(not g.matcher.is_terminated() and g.accept(t) for t in history)
            memo[history] = None if done else dist(1, history, g.verify_bitmask([])[0])[1]
        return memo[history]

    acc, tails = {}, 0
    root = GrammarState(compiled, V)
    for x in itertools.product(range(V), repeat=n):
        drafted = DraftBlock(list(x), None)
        masks = root.verify_bitmask(list(x))
        qs = [dist(2, x[:j], masks[j])[1] for j in range(n)]
        w_path = float(torch.prod(torch.stack([qs[j][x[j]] for j in range(n)])))
        if w_path == 0:
            continue
        drafted.probs = torch.stack(qs).float()  # [n, V]
        tail = forced_tail(root, list(x), limit)
        if corrupt and tail:
            tail = [(tail[0] + 1) % V] + tail[1:]
        tails += bool(tail)
        blk = drafted.extended(tail, V)
        m = len(blk.token_ids)
        qs = qs + [blk.probs[j].double() for j in range(n, m)]
        masks = root.verify_bitmask(blk.token_ids)  # [m+1, W]
        p_rows = [dist(1, tuple(blk.token_ids[:j]), masks[j]) for j in range(m + 1)]
        ps = [r[1] for r in p_rows]
        p_logits = torch.cat([r[0] for r in p_rows])  # [m+1, V]
        a = [float(accept_probability(ps[j][blk.token_ids[j]], qs[j][blk.token_ids[j]])) for j in range(m)]
        for k in range(m + 1):
            w = w_path * float(torch.prod(torch.tensor(a[:k], dtype=torch.float64))) * ((1 - a[k]) if k < m else 1.0)
            if w == 0:
                continue
            last = residual_distribution(ps[k], qs[k]) if k < m else ps[m]
            cdf = torch.cumsum(last, 0)
            for t in range(V):
                if last[t] == 0:
                    continue
                u_acc = torch.tensor([[0.0] * k + ([(a[k] + 1) / 2] if k < m else []) + [0.5] * (m - k - 1)],
                                     dtype=torch.float64)[:, :m]
                u_rec = torch.tensor([((cdf[t - 1] if t else 0.0) + cdf[t]) / 2], dtype=torch.float64)
                res = verify(p_logits, VerifyMetadata.build([blk.token_ids], [False]), blk.probs,
                             draws=(u_acc, u_rec))
                got = tuple(res.tokens(0))
                assert got == tuple(blk.token_ids[:k]) + (t,), (blk.token_ids, k, t, got)
                got = got[: got.index(4) + 1] if 4 in got else got  # the engine commits nothing after EOS
                acc[got] = acc.get(got, 0.0) + w * float(last[t])
    assert tails >= 3  # "a" -> "bc", "b?" -> "cd", "d?" -> EOS, ...

    def extend(start: dict) -> dict:  # every committed prefix continued by the masked target to `horizon`
        out, stack = {}, list(start.items())
        while stack:
            h, wh = stack.pop()
            p = reference(h) if len(h) < horizon else None
            if p is None:  # the horizon or the grammar's end
                out[h] = out.get(h, 0.0) + wh
                continue
            stack += [(h + (t,), wh * float(p[t])) for t in range(V) if p[t] > 0]
        return out

    full, want = extend(acc), extend({(): 1.0})
    assert abs(sum(full.values()) - 1.0) < 1e-9
    tv = 0.5 * sum(abs(full.get(y, 0.0) - want.get(y, 0.0)) for y in set(full) | set(want))
    assert tv <= 1e-9, tv
