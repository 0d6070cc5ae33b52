"""Verification (`verify` over the rejection sampler), statistical tier: 30,000 seeded trials per case against the target's distribution.

Each case builds p (target) and q (draft) with `process_logits` from history-dependent random
logits, exactly as the engine does: the same params for both, and the history at proposed
position j is the committed output plus the proposals before j, so penalties see proposed tokens.
Trials are rows of one batch. Rows that commit fewer than K+1 tokens are extended with the
target's own continuation, so the committed tokens, per position and jointly over K+1
positions, must follow the target's autoregressive distribution (chi-square, alpha = 1e-4).
The acceptance rate of the first proposal is checked too (sum_x min(p(x), q(x))), so a sampler
that ignores the drafts and samples p cannot pass.
"""
from dataclasses import dataclass

import pytest
import torch
from scipy.stats import chisquare

from draftwise.sampling import SamplingParams, VerifyMetadata, probs_from_logits, process_logits, verify

V, K, TRIALS, ALPHA = 6, 2, 30_000, 1e-4
PROMPT = [0, 1, 1, 4]
COMMITTED = [2]


@dataclass
class Case:
    name: str
    p_params: SamplingParams
    q_params: SamplingParams | None = None  # None: the same as p_params
    point_mass: bool = False  # uniform random proposals passed with draft_probs=None


PEN = dict(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.5)
CASES = [
    Case("temperature_0.7", SamplingParams(temperature=0.7)),
    Case("temperature_1.5", SamplingParams(temperature=1.5)),
    Case("top_k", SamplingParams(top_k=3)),
    Case("top_p", SamplingParams(top_p=0.7)),
    Case("min_p", SamplingParams(min_p=0.2, temperature=1.2)),
    Case("penalties", SamplingParams(**PEN)),
    Case("combined", SamplingParams(temperature=0.8, top_k=4, top_p=0.9, **PEN)),
    Case("point_mass", SamplingParams(top_k=4, **PEN), point_mass=True),
    Case("q_support_where_p_is_zero", SamplingParams(top_k=2), SamplingParams(temperature=1.3)),
]


def raw_logits(salt: int, codes: torch.Tensor, level: int) -> torch.Tensor:  # [M] -> [M, V]
    """A fixed random logit vector per history (a stand-in for a model)."""
    rows = [torch.randn(V, generator=torch.Generator().manual_seed(salt * 7919 + level * 1009 + int(c))) * 1.5
            for c in codes]
    return torch.stack(rows)


def tables(params: SamplingParams, salt: int) -> list[torch.Tensor]:
    """Per level l = 0..K, the processed distribution after each history of l proposals:
    [V**l, V], row = the history written in base V."""
    out = []
    for level in range(K + 1):
        codes = torch.arange(V**level)
        histories = [[(c // V ** (level - 1 - i)) % V for i in range(level)] for c in codes.tolist()]
        logits = raw_logits(salt, codes, level)
        m = len(histories)
        processed = process_logits(logits, [params] * m, [PROMPT] * m, [COMMITTED + h for h in histories])
        out.append(probs_from_logits(processed).double())
    return out


def target_joint(p_tables) -> torch.Tensor:  # [V**(K+1)] in base-V order
    joint = p_tables[0][0]
    for level in range(1, K + 1):
        joint = (joint[:, None] * p_tables[level]).reshape(-1)
    return joint


def chi2_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    observed, probs = observed.double(), probs.double()
    assert observed[probs == 0].sum() == 0, "a token of zero target probability was emitted"
    keep = probs > 0
    observed, expected = observed[keep], probs[keep] / probs[keep].sum() * observed.sum()
    small = expected < 5
    if small.any():  # pool bins with tiny expected counts
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        if expected[-1] < 5:
            observed = torch.cat([observed[:-2], observed[-2:].sum()[None]])
            expected = torch.cat([expected[:-2], expected[-2:].sum()[None]])
    if len(expected) < 2:
        return 1.0
    return chisquare(observed.numpy(), expected.numpy()).pvalue


def run_case(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    p_tab = tables(case.p_params, salt=1)
    q_tab = tables(case.q_params or case.p_params, salt=2)

    # Proposals, with the draft's distribution at each proposed position.
    draft = torch.zeros(TRIALS, K, dtype=torch.long)
    q = torch.zeros(TRIALS, K, V, dtype=torch.float32)
    p = torch.zeros(TRIALS, K + 1, V, dtype=torch.float32)
    code = torch.zeros(TRIALS, dtype=torch.long)
    for j in range(K + 1):
        p[:, j] = p_tab[j][code].float()
        if j == K:
            break
        q[:, j] = q_tab[j][code].float()
        if case.point_mass:
            draft[:, j] = torch.randint(0, V, (TRIALS,), generator=g)
        else:
            draft[:, j] = torch.multinomial(q[:, j], 1, generator=g).squeeze(1)
        code = code * V + draft[:, j]

    # through `verify`, the engine's boundary: flat processed logits (log p) and flat q
    meta = VerifyMetadata.build(draft.tolist(), [False] * TRIALS)
    q_flat = None if case.point_mass else q.reshape(TRIALS * K, V)
    res = verify(torch.log(p).reshape(TRIALS * (K + 1), V), meta, q_flat, g)
    assert bool(res.valid.all())
    committed, num_accepted = res.committed, res.num_accepted
    length = num_accepted + 1
    assert bool((committed[:, :K][torch.arange(K)[None, :] < num_accepted[:, None]]
                 == draft[torch.arange(K)[None, :] < num_accepted[:, None]]).all())
    assert bool(((committed >= 0) == (torch.arange(K + 1)[None, :] < length[:, None])).all())

    # Every emitted token had positive target probability given its history.
    code = torch.zeros(TRIALS, dtype=torch.long)
    for j in range(K + 1):
        emitted = j < length
        tok = committed[:, j].clamp(min=0)
        assert bool((p_tab[j][code, tok][emitted] > 0).all()), "zero-probability token committed"
        code = code * V + tok

    # Extend short commits with the target's own continuation, then code the full sequences.
    full = committed.clone()
    code = torch.zeros(TRIALS, dtype=torch.long)
    for j in range(K + 1):
        missing = full[:, j] < 0
        if missing.any():
            full[missing, j] = torch.multinomial(p_tab[j][code[missing]], 1, generator=g).squeeze(1)
        code = code * V + full[:, j]

    # First proposal: accepted with probability sum_x q(x) min(1, p(x)/q(x)).
    p0, q0 = p_tab[0][0], q_tab[0][0]
    accept_rate = (torch.full_like(p0, 1.0 / V) * p0).sum() if case.point_mass else torch.minimum(p0, q0).sum()
    return full, code, p_tab, num_accepted, accept_rate.item()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_committed_tokens_follow_the_target(case):
    seed = 1234 + CASES.index(case)
    full, code, p_tab, num_accepted, accept_rate = run_case(case, seed)
    joint = target_joint(p_tab)  # [V**(K+1)]
    per_pos = joint.reshape([V] * (K + 1))
    for j in range(K + 1):
        marginal = per_pos.sum(dim=[d for d in range(K + 1) if d != j])
        observed = torch.bincount(full[:, j], minlength=V)
        pv = chi2_pvalue(observed, marginal)
        assert pv > ALPHA, f"{case.name}: position {j} chi-square p-value {pv:.2e}"
    pv = chi2_pvalue(torch.bincount(code, minlength=V ** (K + 1)), joint)
    assert pv > ALPHA, f"{case.name}: joint chi-square p-value {pv:.2e}"

    observed_rate = (num_accepted >= 1).double().mean().item()
    sd = (accept_rate * (1 - accept_rate) / TRIALS) ** 0.5
    assert abs(observed_rate - accept_rate) < 4.5 * sd + 1e-12, (observed_rate, accept_rate)


def test_zero_probability_tokens_are_emitted_never():
    case = CASES[-1]
    full, code, p_tab, num_accepted, _ = run_case(case, seed=99)
    q0 = tables(case.q_params, salt=2)[0][0]
    assert bool(((p_tab[0][0] == 0) & (q0 > 0)).any())  # the case really has q > 0 where p = 0
    assert bool((p_tab[0][0][full[:, 0]] > 0).all())
