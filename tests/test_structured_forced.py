"""Grammar-forced proposals beyond k: proposed and verified as free rows, a wrong one rejected,
every policy with constraints at c=1 and batched, the bench's forced budget, blocks whose forced tail
is done, the server's per-position sums.
"""

import pytest

from draftwise import LLM, SamplingParams, SpecConfig
from structured_helpers import PROMPTS, REGEX, SCHEMA, llms, matches, pair  # noqa: F401 (pytest fixtures)


# ------------------------------------------------------------------ forced proposals beyond k
def _committed_max(llm) -> int:
    return max(int(c) for c in llm.engine.stats.committed_per_round)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_forced_tokens_beyond_k_are_proposed_and_verified(llms, pair, method):
    """k=1: a round verifies the drafter's proposal and the tokens the grammar forces before or
    after it (free proposals; this tokenizer forces single tokens of '{"ok": ', ', "kind": "'
    and the end), so rounds commit more than k + 1 tokens and the mean accepted length rises;
    with forced=0 no round passes k + 1. Both equal plain greedy."""
    target, draft = pair
    sp = SamplingParams(temperature=0.0, max_tokens=48, structured_output={"json_schema": SCHEMA})
    want = [o.token_ids for o in llms["plain"].generate(PROMPTS, sp)]
    runs = {}
    for forced in (0, 16):
        llm = LLM(target, draft=draft if method == "draft" else None, spec=SpecConfig(method=method, k=1, forced=forced))
        outs = llm.generate(PROMPTS, sp)
        assert [o.token_ids for o in outs] == want
        assert all(o.finish_reason == "stop" and matches("json_schema", o.text) for o in outs)
        st = llm.engine.stats
        runs[forced] = (st.forced_tokens, _committed_max(llm), st.committed_tokens / st.rounds)
        assert all(o.stats.accepted_tokens <= o.stats.proposed_tokens for o in outs)  # forced ones count as proposed
        assert st.accepted_tokens <= st.verified_tokens <= st.proposed_tokens
    assert runs[0][0] == 0 and runs[0][1] <= 2
    assert runs[16][0] > 0 and runs[16][1] > 2
    assert runs[16][2] > runs[0][2], runs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_wrong_forced_token_is_rejected(llms, pair, monkeypatch, temperature):
    """Verification, not trust: forced tokens whose first one is replaced by another (a bug that
    proposes an illegal "forced" token, q a point mass on it; the draft model appends forced
    tokens without checking them) are rejected by the masked target, the matcher never sees
    them, and greedy output is still plain greedy output."""
    from draftwise.sampling.grammar import GrammarCursor

    target, draft = pair
    injected, right = [], GrammarCursor.forced_tokens

    def wrong(self, limit):
        out = right(self, limit)
        if out:
            out[0] = (out[0] + 1) % 400
            injected.append(out[0])
        return out

    monkeypatch.setattr(GrammarCursor, "forced_tokens", wrong)
    sp = SamplingParams(temperature=temperature, max_tokens=48, seed=3, structured_output={"json_schema": SCHEMA})
    llm = LLM(target, draft=draft, spec=SpecConfig(method="draft", k=2))
    outs = llm.generate(PROMPTS, [sp] * len(PROMPTS))
    assert injected
    assert all(o.finish_reason == "stop" and matches("json_schema", o.text) for o in outs)
    if temperature == 0.0:
        assert [o.token_ids for o in outs] == [o.token_ids for o in llms["plain"].generate(PROMPTS, sp)]
    st = llm.engine.stats
    assert st.accepted_tokens < st.verified_tokens  # the wrong ones were rejected


@pytest.mark.parametrize("policy", ["fixed", "adaptive", "goodput"])
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_policies_with_constraints_at_c1_and_batched(llms, pair, method, policy):
    """The verification policies (goodput: with a fixed cost model) together with constraints:
    greedy speculative == greedy plain and every output valid, one request at a time and 8 in
    flight mixing constrained and free rows; sampled constrained outputs valid."""
    from draftwise.policies import CostModel

    target, draft = pair
    cost = CostModel((0.003, 0.0002, 0.0004, 0.0), (0.0003, 0.00005, 0.0))
    llm = LLM(target, draft=draft if method == "draft" else None,
              spec=SpecConfig(method=method, k=3, policy=policy, cost_model=cost))
    json_sp = SamplingParams(temperature=0.0, max_tokens=40, structured_output={"json_schema": SCHEMA})
    regex_sp = SamplingParams(temperature=0.0, max_tokens=12, structured_output={"regex": REGEX})
    free_sp = SamplingParams(temperature=0.0, max_tokens=12)
    params = [json_sp, regex_sp, free_sp, json_sp] * 2
    prompts = [PROMPTS[i % 4] for i in range(8)]
    want = [o.token_ids for o in llms["plain"].generate(prompts, params)]
    one_by_one = [llm.generate(p, sp)[0] for p, sp in zip(prompts[:4], params[:4])]
    batched = llm.generate(prompts, params)
    assert [o.token_ids for o in one_by_one] == want[:4]
    assert [o.token_ids for o in batched] == want
    for o, sp in zip(batched, params):
        if sp is json_sp:
            assert o.finish_reason == "stop" and matches("json_schema", o.text), o.text
        elif sp is regex_sp:
            assert o.finish_reason == "stop" and matches("regex", o.text), o.text
    sampled = SamplingParams(temperature=1.0, max_tokens=40, seed=7, structured_output={"json_schema": SCHEMA})
    for o in llm.generate(prompts, [sampled] * 8):
        assert o.finish_reason == "stop" and matches("json_schema", o.text), o.text


def test_bench_configs_set_the_forced_budget():
    from draftwise.lab.runner import parse_configs

    cfgs = {c.label: c for c in parse_configs("draft:k=4:forced=0,ngram:k=2,draft:k=4")}
    assert cfgs["draft:k=4:forced=0"].spec.forced == 0 and cfgs["draft:k=4"].spec.forced == SpecConfig.forced
    assert cfgs["ngram:k=2"].spec.max_forced == SpecConfig.forced and cfgs["none"].spec.max_forced == 0
    for bad in ("draft:k=4:forced=x", "draft:k=4:forced=65"):
        with pytest.raises(ValueError, match="forced"):
            parse_configs(bad)


def test_draft_blocks_marked_forced_done_have_no_forced_tail(pair):
    """The draft model marks a block after which the grammar forces nothing (the engine then skips
    its own look): checked against `forced_tail` on every block it returns."""
    from draftwise.sampling.grammar import forced_tail

    target, draft = pair
    llm = LLM(target, draft=draft, spec=SpecConfig(method="draft", k=2, forced=3))
    eng, seen = llm.engine, {True: 0, False: 0}
    propose = eng.proposer.propose

    def checked(seqs, plan, forced=None):
        blocks = propose(seqs, plan, forced)
        for s, b in zip(seqs, blocks):
            if s.grammar is not None and b.token_ids:
                seen[b.forced_done] += 1
                if b.forced_done:
                    assert forced_tail(s.grammar, b.token_ids, 64) == [], b.token_ids
        return blocks

    eng.proposer.propose = checked
    sp = SamplingParams(temperature=0.0, max_tokens=48, structured_output={"json_schema": SCHEMA})
    outs = llm.generate(PROMPTS, sp)
    assert all(matches("json_schema", o.text) for o in outs)
    assert seen[True] > 0 and seen[False] > 0, seen


def test_server_summary_sums_per_position_lists_of_any_length():
    from draftwise.server.serving import spec_summary

    stats = [{"rounds": 1, "mean_accepted_length": 7.0, "proposed_tokens": 6, "accepted_tokens": 6,
              "accepted_per_position": [1, 1, 1, 1, 1, 1], "preemptions": 0},
             {"rounds": 1, "mean_accepted_length": 2.0, "proposed_tokens": 2, "accepted_tokens": 1,
              "accepted_per_position": [1, 0], "preemptions": 0}]
    assert spec_summary(stats, "ngram", 2)["accepted_per_position"] == [2, 1, 1, 1, 1, 1]
