"""Suffix draft lengths sized by the step's cost (proposers/suffix_length.py) and their calibration."""
from __future__ import annotations

import pytest

from draftwise.llm import LLM
from draftwise.engine.config import SpecConfig
from draftwise.proposers.base import DraftBlock, StepCosted
from draftwise.proposers.suffix import SuffixProposer
from draftwise.proposers.suffix_length import AcceptanceTable, best_lengths, match_bucket
from draftwise.sampling import SamplingParams


class History:
    def __init__(self, prompt, output=(), seq_id=1):
        self.prompt_ids, self.output_ids, self.seq_id, self.grammar = list(prompt), list(output), seq_id, None


class LinearCost:
    """seconds(B, T) = base + per_token * (T - B): a row's own token is in the base."""

    def __init__(self, base: float, per_token: float):
        self.base, self.per_token = base, per_token

    def tokens_seconds(self, num_seqs, context):
        return lambda t: self.base + self.per_token * (t - num_seqs)


# ------------------------------------------------------------------ the length rule
@pytest.mark.parametrize("per_token, want", [(0.5, [1]), (0.1, [2]), (0.0, [3])])
def test_length_maximises_expected_tokens_per_second(per_token, want):
    # (1 + 0.9) / 1.5 > 2.4 / 2.0 at 0.5 a row; 2.4 / 1.2 > 1.9 / 1.1 and > 2.5 / 1.3 at 0.1; all when rows are free
    assert best_lengths([[0.9, 0.5, 0.1]], lambda t: 1.0 + per_token * (t - 1)) == want


def test_rows_share_the_step():
    # 2.9 / 2.2 < 3.7 / 2.4 > 4.0 / 2.6: the second row's weak guess does not pay for its row
    assert best_lengths([[0.9, 0.8], [0.3]], lambda t: 2.0 + 0.2 * (t - 2)) == [2, 0]
    assert best_lengths([[0.9, 0.8], [0.3]], lambda t: 2.0) == [2, 1]
    assert best_lengths([[], [0.5]], lambda t: 1.0) == [0, 1]


def test_dearer_rows_never_lengthen_a_draft():
    gains = [[0.95, 0.9, 0.7, 0.69, 0.3, 0.29, 0.05]]
    lengths = [best_lengths(gains, lambda t, c=c: 1.0 + c * (t - 1))[0] for c in (0.0, 0.02, 0.1, 0.3, 1.0, 5.0)]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] == 7 and lengths[-1] == 0


def test_a_second_pass_over_the_weights_is_learned_and_stops_a_draft_short_of_it():
    from draftwise.policies.cost import CostModel, OnlineCost

    # measured steps of one row: 50 ms + 3 ms a token fed, 20 ms more past 16 tokens (a second block of tiles)
    def measured(t):
        return 0.050 + 0.003 * t + (0.020 if t > 16 else 0.0)

    flat, tiled = (OnlineCost(CostModel((0.0,) * 4, (0.0,) * 3), row_block=r) for r in (0, 16))
    for i in range(400):
        t = 1 + (i * 7) % 17  # 1..17 tokens
        for model in (flat, tiled):
            model.observe(1, t, 100.0, [], measured(t))
    for t in (1, 8, 16, 17):
        assert tiled.step_seconds(1, t, 100.0) == pytest.approx(measured(t), rel=0.02)
    assert tiled.step_seconds(1, 33, 100.0) == pytest.approx(0.050 + 0.003 * 33 + 0.040, rel=0.02)
    # a copy accepted throughout: a line in T keeps all 16 proposals (17 rows), the passes stop at 15
    gains = [[0.99] * 16]
    assert best_lengths(gains, flat.tokens_seconds(1, 100.0)) == [16]
    assert best_lengths(gains, tiled.tokens_seconds(1, 100.0)) == [15]
    # steps that never went past a block teach no pass cost
    short = OnlineCost(CostModel((0.0,) * 4, (0.0,) * 3), row_block=16)
    for i in range(100):
        short.observe(1, 1 + i % 16, 100.0, [], measured(1 + i % 16))
    assert short.tokens_seconds(1, 100.0)(17) == pytest.approx(0.050 + 0.003 * 17, rel=0.02)


# ------------------------------------------------------------------ the calibration
def test_only_tested_proposals_are_counted():
    table = AcceptanceTable()
    table.observe(m=5, num_verified=6, num_accepted=2)  # 1, 2 accepted, 3 rejected, 4..6 never tested
    b = match_bucket(5)
    assert table.cells == {(b, 1): [1.0, 1.0], (b, 2): [1.0, 1.0], (b, 3): [0.0, 1.0]}
    table.observe(m=5, num_verified=2, num_accepted=2)  # all verified accepted: the third was not tested
    assert set(table.cells) == {(b, 1), (b, 2), (b, 3)}
    assert table.cells[(b, 1)][1] == pytest.approx(1.999)


def test_rates_move_from_the_prior_to_what_was_measured():
    table = AcceptanceTable()
    assert table.rate(3, 1, prior=0.5) == pytest.approx(0.5)
    for _ in range(200):
        table.observe(m=3, num_verified=4, num_accepted=0)  # the first proposal always rejected
    assert table.rate(3, 1, prior=0.5) < 0.02
    assert table.rate(3, 2, prior=0.5) == pytest.approx(0.5)  # never tested
    assert table.rate(12, 1, prior=0.5) == pytest.approx(0.5)  # another match-length bucket
    assert table.gains(3, [0.5, 0.5]) == pytest.approx([table.rate(3, 1, 0.5), table.rate(3, 1, 0.5) * 0.5])


# ------------------------------------------------------------------ the proposer
TEXT = list(range(10, 40))


def test_proposer_sizes_its_draft_by_the_step_cost():
    prop = SuffixProposer(suffix_depth=8)
    assert isinstance(prop, StepCosted)
    h = History(TEXT, TEXT[:7])  # a match of 7 (depth - 1): spec_factor drafts 7
    assert prop.propose([h], [16])[0].token_ids == TEXT[7:14]
    prop.set_step_cost(LinearCost(1.0, 0.0))  # free rows: the whole draft
    assert prop.propose([h], [16])[0].token_ids == TEXT[7:14]
    prop.set_step_cost(LinearCost(1.0, 10.0))  # a row costs ten steps: nothing pays
    assert prop.propose([h], [16])[0].token_ids == []
    # estimates 1 - 1/(7 + j): G = 0.875, 0.778, 0.7, ...; at 0.8 of a step a row, 1.875 / 1.8 beats
    # 2.653 / 2.6 and 1 / 1; at 0.4, four rows (3.989 / 2.6)
    prop.set_step_cost(LinearCost(1.0, 0.8))
    assert prop.propose([h], [16])[0].token_ids == TEXT[7:8]
    prop.set_step_cost(LinearCost(1.0, 0.4))
    assert prop.propose([h], [16])[0].token_ids == TEXT[7:11]


def test_a_step_cut_to_nothing_is_verified_whole_now_and_then():
    prop = SuffixProposer(suffix_depth=8)
    h = History(TEXT, TEXT[:7])
    prop.set_step_cost(LinearCost(1.0, 10.0))  # a row costs ten steps: the rule keeps nothing
    lengths = [len(prop.propose([h], [16])[0].token_ids) for _ in range(2 * SuffixProposer.PROBE_EVERY)]
    probes = [SuffixProposer.PROBE_EVERY - 1, 2 * SuffixProposer.PROBE_EVERY - 1]
    assert [i for i, n in enumerate(lengths) if n] == probes and lengths[probes[0]] == 7
    prop.set_step_cost(LinearCost(1.0, 0.0))  # steps the rule keeps something of are no probes
    assert len(prop.propose([h], [16])[0].token_ids) == 7 and prop.cut_steps == 2 * SuffixProposer.PROBE_EVERY


def test_proposer_learns_from_verified_proposals_only():
    prop = SuffixProposer(suffix_depth=8)
    prop.set_step_cost(LinearCost(1.0, 0.0))
    h = History(TEXT, TEXT[:2], seq_id=4)
    block = prop.propose([h], [8])[0]
    prop.observe_verified(h, block.truncated(3), 3, 1)  # the policy verified 3; the second was rejected
    b = match_bucket(2)
    assert prop.acceptance.cells == {(b, 1): [1.0, 1.0], (b, 2): [0.0, 1.0]}
    prop.observe_verified(h, block, 8, 8)  # no draft outstanding for the row any more: ignored
    other = prop.propose([h], [8])[0]
    prop.observe_verified(h, DraftBlock([1, 2, 3], None), 3, 3)  # not the row's last draft: ignored
    prop.observe_verified(h, other, 0, 0)
    assert prop.acceptance.cells == {(b, 1): [1.0, 1.0], (b, 2): [0.0, 1.0]}
    # the rejected second proposal lowers what the next draft of this bucket keeps when rows cost
    prop.set_step_cost(LinearCost(1.0, 0.45))
    for _ in range(20):
        block = prop.propose([h], [8])[0]
        prop.observe_verified(h, block, len(block.token_ids), min(1, len(block.token_ids)))
    assert len(prop.propose([h], [8])[0].token_ids) == 1


def test_engine_hands_suffix_its_step_cost_and_stays_exact(target_dir):
    prompts = [[7, 8, 9, 10, 11, 12, 13, 14] * 4, [5, 6, 5, 6, 5, 6, 5]]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    base = LLM(str(target_dir)).generate(prompts, sp)
    llm = LLM(str(target_dir), spec=SpecConfig(method="suffix", k=16))
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    prop = llm.engine.speculation.proposer
    assert prop.step_cost is llm.engine.speculation.step_cost and prop.acceptance.cells
    assert prop.step_cost.row_block == 0  # a float32 target: no passes of 16 rows to learn
    assert not prop.drafted  # finished rows leave no outstanding draft
