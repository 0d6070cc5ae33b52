"""Trees sized by the price of a verified row (proposers/tree_budget.py): the calibration of node
acceptance from verified trees, trees that shrink to chains and to nothing as the price rises,
the price a policy states reaching the drafter through the engine, and the goodput policy's
price."""
import random

import pytest

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.engine.sequence import Sequence
from draftwise.model import load_model
from draftwise.policies import CostModel, StepHints, policy_class, register_policy
from draftwise.policies.fixed import FixedPolicy
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.tree_budget import NUM_BINS, PRIOR_WEIGHT, NodeCalibration, TreeBudget
from tiny_models import make_model_dir


@pytest.fixture(scope="module")
def near_draft_dir(tmp_path_factory, tokenizer):
    # (peaked distributions: q's top tokens differ enough for prices to tell them apart)
    return make_model_dir(tmp_path_factory.mktemp("near-draft-budget"), seed=0, tokenizer=tokenizer, perturb=0.15,
                          init_std=3.0)


def test_calibration_counts_the_tested_nodes_only():
    cal = NodeCalibration()
    # 0, 1 under the root; 2 under 0; 3 under 1; 4 under 2. Accepted path: 0 then 2.
    # Tested: 0, 1 (the root's children), 2 (under accepted 0), 4 (under accepted 2); 3 is not.
    qs = [0.93, 0.33, 0.63, 0.13, 0.43]
    cal.observe((-1, -1, 0, 1, 2), qs, [True, False, True, True, True], [0, 2])
    prior = [(b + 0.5) / NUM_BINS for b in range(NUM_BINS)]
    for q, first, accepted in ((0.93, True, 1.0), (0.63, True, 1.0), (0.33, False, 0.0), (0.43, True, 0.0)):
        b = int(q * NUM_BINS)
        acc, n = cal.tables[first][b]
        assert n == pytest.approx(PRIOR_WEIGHT * 0.999 + 1.0)
        assert acc == pytest.approx(prior[b] * PRIOR_WEIGHT * 0.999 + accepted)
        assert cal.tables[not first][b] == [prior[b] * PRIOR_WEIGHT, PRIOR_WEIGHT]  # the other kind: its prior
    assert cal.tables[True][int(0.13 * NUM_BINS)] == [prior[int(0.13 * NUM_BINS)] * PRIOR_WEIGHT, PRIOR_WEIGHT]
    assert cal.rate(0.93, True) > 0.93 == pytest.approx(cal.rate(0.93, False))
    assert cal.rate(0.33, False) < 0.33


def drafted_tree(target_dir, near_draft_dir, price: float, cap: int = 6, fused: bool = True):
    target = load_model(target_dir)
    draft = load_model(near_draft_dir, load_tokenizer=False)
    prop = DraftModelProposer(draft=draft, target=target, num_blocks=64, block_size=4, tree=3)
    prop.fused_steps = fused  # True: a spine and its runners-up from the fused steps; False: depth by depth
    rng = random.Random(4)
    prompt = [rng.randrange(1, target.config.vocab_size) for _ in range(9)]
    seq = Sequence("r", prompt, SamplingParams(temperature=0, max_tokens=8))
    prop.kv.reserve(seq.seq_id, len(prompt) + cap)
    prop.set_tree_budget(TreeBudget(price, [cap]))
    return prop.propose([seq], [1 if price > 0 else cap])[0]


@pytest.mark.parametrize("fused", [True, False], ids=["spine", "depth-by-depth"])
def test_trees_shrink_to_chains_and_to_nothing_as_the_price_rises(target_dir, near_draft_dir, fused):
    """Before any verification a node's gain is the product of q along its path: as the price
    rises past the gains, nodes drop (never added), down to the best node alone (a chain) and to
    none (plain decoding)."""
    sizes, shapes = [], []
    for price in [0.0] + [10 ** (-4 + e / 15) for e in range(61)]:
        blk = drafted_tree(target_dir, near_draft_dir, price, fused=fused)
        sizes.append(len(blk.token_ids))
        shapes.append(blk.parents or ())
    assert sizes[0] == 6 and sizes[-1] == 0, sizes
    assert all(a >= b for a, b in zip(sizes, sizes[1:])), sizes  # a higher price, never more nodes
    assert any(p != tuple(range(-1, len(p) - 1)) for p in shapes), "some price drafts a real tree"
    assert (-1,) in shapes, "some price keeps the best node alone"


@register_policy("priced-test")
class PricedPolicy(FixedPolicy):
    """The fixed policy stating a price too high for any node: trees shrink to nothing."""

    def hints(self) -> StepHints:
        return StepHints(reads_confidence=False, node_price=2.0)


def test_a_policys_price_reaches_the_drafter_through_the_engine(target_dir, near_draft_dir):
    plain = LLM(str(target_dir))
    rng = random.Random(2)
    ps = [[rng.randrange(1, plain.engine.vocab_size) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = plain.generate(ps, sp)
    outs = {}
    for policy in ("fixed", "priced-test"):
        spec = SpecConfig(method="draft", k=4, tree=2, policy=policy)
        llm = LLM(str(target_dir), draft=str(near_draft_dir), spec=spec, draft_dtype="float32")
        outs[policy] = llm.generate(ps, sp)
        assert [o.token_ids for o in outs[policy]] == [b.token_ids for b in base]
    assert sum(o.stats.proposed_tokens for o in outs["fixed"]) > 0
    assert sum(o.stats.proposed_tokens for o in outs["priced-test"]) == 0


def test_goodput_prices_a_row_by_its_marginal_seconds_at_the_planned_rate():
    """At one row and at sixteen the first plan is a "spec" step here; the stated price is lambda *
    dcost/dtoken of the planned step, and more rows (a higher rate, the same seconds per token)
    price a row higher."""
    cost = CostModel((0.005, 0.002, 0.001, 1e-6), (0.0005, 0.0001, 0.0))
    prices = {}
    for b in (1, 16):
        policy = policy_class("goodput")(k=4, cost=cost, has_draft_model=True)
        seqs = [Sequence(f"r{i}", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=64)) for i in range(b)]
        lengths = policy.plan(seqs, [4] * b)
        hints = policy.hints()
        assert hints.arm == "spec" and any(lengths)
        assert hints.node_price == pytest.approx(policy.core.row_price(seqs))
        prices[b] = hints.node_price
    assert 0 < prices[1] < prices[16]


def test_sampled_draws_are_tested_in_turn_until_one_is_accepted():
    cal = NodeCalibration()
    # the root's draws 0, 1, 2 (slot max q 0.33); 3, 4 under 1 (0.63). Path: 1 then 4: draw 0
    # rejected, 1 accepted, 2 never tested; under 1, draw 3 rejected, 4 accepted.
    before = [row[:] for kind in cal.tables for row in kind]
    cal.observe_draws((-1, -1, -1, 1, 1), [0.33, 0.33, 0.33, 0.63, 0.63], [1, 4])
    b1, b2 = int(0.33 * NUM_BINS), int(0.63 * NUM_BINS)
    prior = [(b + 0.5) / NUM_BINS * PRIOR_WEIGHT for b in range(NUM_BINS)]
    assert cal.tables[True][b1] == pytest.approx([prior[b1] * 0.999, PRIOR_WEIGHT * 0.999 + 1])  # draw 0: rejected
    assert cal.tables[False][b1] == pytest.approx([prior[b1] * 0.999 + 1, PRIOR_WEIGHT * 0.999 + 1])  # draw 1 only
    assert cal.tables[True][b2] == pytest.approx([prior[b2] * 0.999, PRIOR_WEIGHT * 0.999 + 1])
    assert cal.tables[False][b2] == pytest.approx([prior[b2] * 0.999 + 1, PRIOR_WEIGHT * 0.999 + 1])
    changed = sum(a != b for a, b in zip(before, [row for kind in cal.tables for row in kind]))
    assert changed == 4


def _sampled_rows(target_dir, near_draft_dir, tree: int, seed: int, prompt_len: int, k: int):
    """A draft-model proposer with `tree` and three sampled rows of random prompts, K/V reserved."""
    target = load_model(target_dir)
    draft = load_model(near_draft_dir, load_tokenizer=False)
    prop = DraftModelProposer(draft=draft, target=target, num_blocks=64, block_size=4, tree=tree)
    rng = random.Random(seed)
    V = target.config.vocab_size
    seqs = [Sequence(f"r{i}", [rng.randrange(1, V) for _ in range(prompt_len)],
                     SamplingParams(temperature=1.0, seed=i)) for i in range(3)]
    for s in seqs:
        prop.kv.reserve(s.seq_id, prompt_len + k)
    return prop, seqs


def test_sampled_trees_stop_branching_where_later_draws_are_never_accepted(target_dir, near_draft_dir):
    prop, seqs = _sampled_rows(target_dir, near_draft_dir, tree=3, seed=5, prompt_len=8, k=6)
    first = prop.propose(seqs, [6] * 3)
    assert any(len(set(b.parents)) < len(b.parents) for b in first), "unsure slots branch at first"
    for n in range(3000):  # verified trees where a slot's first draw is accepted, a later one never
        prop.draw_calibration.observe_draws((-1, -1, 1, 1), [0.05 * (n % 20)] * 4, [0, 2])
        prop.draw_calibration.observe_draws((-1, -1), [0.05 * (n % 20)] * 2, [])
    for s in seqs:
        prop.finish(s)
    again = prop.propose(seqs, [6] * 3)
    assert all(b.parents == tuple(range(-1, len(b.parents) - 1)) for b in again), [b.parents for b in again]


def test_sampled_trees_fill_their_budget_within_a_chains_drafter_cache(target_dir, near_draft_dir):
    """Each sampled row's tree holds its k nodes (parents first), feeds at most k - 1 of them to the
    drafter (the K/V a chain of k reserves), at most `tree` per row in one forward, every node
    with children among them, and carries q at the root and at each fed slot (a leaf's: zeros)."""
    prop, seqs = _sampled_rows(target_dir, near_draft_dir, tree=2, seed=6, prompt_len=7, k=8)
    fed_per_call = []
    run = prop.runner.run

    def spy(seq_ids, new_tokens, starts, num_logits, **kw):
        if kw.get("trees") is not None:
            fed_per_call.append([len(t) for t in new_tokens])
        return run(seq_ids, new_tokens, starts, num_logits, **kw)

    prop.runner.run = spy
    blocks = prop.propose(seqs, [8] * 3)
    assert fed_per_call and all(1 <= n <= 2 for call in fed_per_call for n in call)
    for b in blocks:
        assert len(b.token_ids) == 8 and all(-1 <= p < i for i, p in enumerate(b.parents))
        fed = [i for i in range(8) if b.probs[i + 1].sum() > 0]  # nodes whose slot carries q
        assert b.probs[0].sum() == pytest.approx(1.0, abs=1e-5) and len(fed) <= 7
        assert {p for p in b.parents if p >= 0} <= set(fed)  # a node with children was fed
    assert sum(n for call in fed_per_call for n in call) == sum(
        sum(1 for i in range(8) if b.probs[i + 1].sum() > 0) for b in blocks)
    assert any(len(set(b.parents)) < len(b.parents) for b in blocks), "some slot holds siblings"
