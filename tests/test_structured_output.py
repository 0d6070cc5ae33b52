"""Structured output under speculation (xgrammar): every output matches its constraint, greedy
speculative == greedy plain under the same constraint, the constrained distribution is kept at
T=1, proposals (accepted or rejected) never advance a sequence's matcher, and invalid constraints
are clear errors (ValueError, HTTP 400, CLI exit 2). The exact tiers are in
test_structured_exact.py, forced proposals beyond k in test_structured_forced.py.
"""
import json
import re

import httpx
import openai
import pytest
import torch
from scipy.stats import chi2_contingency

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.cli.main import main as cli_main
from draftwise.proposers import DraftBlock
from draftwise.proposers.base import register_proposer
from draftwise.sampling import process_logits
from draftwise.sampling.grammar import GrammarState, allowed_from_bitmask, compile_constraint
from server_harness import ServerThread
from structured_helpers import CHOICE, CONSTRAINTS, PROMPTS, REGEX, SCHEMA, llms, matches, pair  # noqa: F401 (pytest fixtures)


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("spec, match", [
    ({"json_schema": {"type": 5}}, "structured_output.json_schema is invalid"),
    ({"json_schema": "{nope"}, "structured_output.json_schema is invalid"),
    ({"regex": "(ab"}, "structured_output.regex is invalid.*parenthesis"),
    ({"grammar": "root ::= foo"}, "structured_output.grammar is invalid.*foo"),
    ({"choice": []}, "structured_output.choice must be"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"xml": "a"}, "unknown kind"),
])
def test_invalid_constraint_is_a_value_error(spec, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_output=spec)


def test_normalised_constraint_survives_replace():
    import dataclasses

    sp = SamplingParams(structured_output={"json_schema": SCHEMA})
    assert json.loads(sp.structured_output["json_schema"]) == SCHEMA
    for spec in ({"choice": CHOICE}, {"json_object": True}, {"regex": REGEX}):
        sp = SamplingParams(structured_output=spec)
        assert dataclasses.replace(sp, seed=3).structured_output == sp.structured_output


# ------------------------------------------------------------------ outputs match
@pytest.mark.parametrize("method", ["plain", "draft", "ngram"])
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_outputs_match_constraint_greedy_and_sampled(llms, method, kind):
    llm = llms[method]
    for temp in (0.0, 1.0):
        sp = SamplingParams(temperature=temp, max_tokens=48, seed=7, structured_output=CONSTRAINTS[kind])
        plain = SamplingParams(temperature=temp, max_tokens=8, seed=7)
        # a batch mixing constrained and unconstrained rows
        outs = llm.generate(PROMPTS + PROMPTS[:1], [sp] * len(PROMPTS) + [plain])
        for o in outs[:-1]:
            assert o.finish_reason == "stop", (o.text, o.finish_reason)
            assert matches(kind, o.text), o.text
        assert outs[-1].finish_reason in ("length", "stop")


def test_sixteen_in_flight_with_penalties_logprobs_stops_and_a_policy(pair):
    """Concurrency 16 (constrained and unconstrained rows), repetition/presence penalties,
    logprobs, a stop string and the adaptive policy, all together with the constraint."""
    target, draft = pair
    llm = LLM(target, draft=draft, spec=SpecConfig(method="draft", k=4, policy="adaptive"))
    sp = SamplingParams(temperature=1.0, max_tokens=48, seed=5, repetition_penalty=1.3, presence_penalty=0.5,
                        logprobs=2, structured_output={"json_schema": SCHEMA})
    stop = SamplingParams(temperature=0.0, max_tokens=48, stop=["kind"], structured_output={"json_schema": SCHEMA})
    free = SamplingParams(temperature=1.0, max_tokens=12, seed=5)
    params = [sp] * 10 + [stop] * 3 + [free] * 3
    outs = llm.generate([PROMPTS[i % 4] for i in range(16)], params)
    for o in outs[:10]:
        assert o.finish_reason == "stop" and matches("json_schema", o.text), o.text
        assert len(o.logprobs) == len(o.token_ids)
        for lp in o.logprobs:  # log-probabilities of the masked p: the committed token is allowed
            assert lp.logprob > float("-inf") and lp.top[0][1] >= lp.logprob
    for o in outs[10:13]:
        assert o.finish_reason == "stop" and o.text.startswith('{"ok": ') and "kind" not in o.text
    assert all(o.finish_reason == "length" for o in outs[13:])


def test_max_tokens_leaves_a_valid_prefix(llms, pair):
    llm = llms["draft"]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=5, seed=1,
                                                structured_output={"json_schema": SCHEMA}))
    tok = llm.tokenizer
    for o in outs:
        assert o.finish_reason == "length" and len(o.token_ids) == 5
        fresh = GrammarState.create(tok, llm.engine.vocab_size, llm.engine.eos_ids, {"json_schema": json.dumps(SCHEMA)})
        for t in o.token_ids:
            fresh.accept(t)  # raises if the prefix is not one the grammar allows


@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_speculative_equals_plain_under_constraint(llms, method, kind):
    sp = SamplingParams(temperature=0.0, max_tokens=48, structured_output=CONSTRAINTS[kind])
    want = [o.token_ids for o in llms["plain"].generate(PROMPTS, sp)]
    got = [o.token_ids for o in llms[method].generate(PROMPTS, sp)]
    assert got == want


def test_json_object(llms):
    outs = llms["draft"].generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=40,
                                                              structured_output={"json_object": True}))
    for o in outs:  # a random model may not close the object within 40 tokens: check what it wrote
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.text.lstrip().startswith("{")


# ------------------------------------------------------------------ distribution
def test_distribution_under_constraint_is_kept(llms):
    """Chi-square: speculative (draft) vs plain sampling at T=1 under a regex with 9 outcomes."""
    regex = r"(a|b|cc)(x|yy|z)"
    n = 300
    counts = []
    for method in ("plain", "draft"):
        params = [SamplingParams(temperature=1.0, max_tokens=8, seed=1000 * (method == "draft") + i,
                                 structured_output={"regex": regex}) for i in range(n)]
        texts = [o.text for o in llms[method].generate([PROMPTS[0]] * n, params)]
        assert all(re.fullmatch(regex, t) for t in texts)
        counts.append(texts)
    outcomes = sorted(set(counts[0]) | set(counts[1]))
    table = [[c.count(x) for x in outcomes] for c in counts]
    assert len(outcomes) >= 3
    assert chi2_contingency(table).pvalue > 1e-3, (outcomes, table)


def test_mask_on_p_and_q_is_the_same_function(llms):
    """process_logits applies the bitmask before everything else: masked tokens get 0 mass."""
    llm = llms["plain"]
    eng = llm.engine
    g = GrammarState.create(eng.tokenizer, eng.vocab_size, eng.eos_ids, {"regex": REGEX})
    bm = g.verify_bitmask([eng.encode("a")[0], eng.encode("q")[0]])  # [3, W]
    allowed = allowed_from_bitmask(bm, eng.vocab_size)
    assert allowed[0].sum() > 0 and allowed[1].sum() > 0
    assert allowed[2].all()  # after a forbidden proposal: unconstrained (never committed from)
    logits = torch.randn(3, eng.vocab_size)
    sp = SamplingParams(temperature=0.7, top_p=0.9)
    out = process_logits(logits, [sp] * 3, [[1]] * 3, [[]] * 3, token_bitmask=bm)
    assert torch.isinf(out[:2][~allowed[:2]]).all()
    assert torch.isfinite(out[:2]).any(dim=-1).all()


# ------------------------------------------------------------------ the matcher follows the committed path
@register_proposer("forbidden-test")
class ForbiddenProposer:
    """Proposes tokens the grammar forbids first, then the grammar's own forced continuation."""

    kv = None
    needs_draft_model = False
    feature_layers = ()
    bad: list[int] = []

    def __init__(self, **_):
        pass

    def propose(self, seqs, num_draft, num_forced=None):
        return [DraftBlock((self.bad * 8)[:n], None) for n in num_draft]

    def postprocess(self, seq, block, num_accepted, num_tokens_before):
        pass

    def finish(self, seq):
        pass


def same_state(a, b, vocab_size) -> bool:
    if a.is_terminated or b.is_terminated:
        return a.is_terminated == b.is_terminated
    ma, mb = a.verify_bitmask([]), b.verify_bitmask([])
    return torch.equal(ma, mb) and a.matcher.find_jump_forward_string() == b.matcher.find_jump_forward_string()


@pytest.mark.parametrize("method", ["draft", "forbidden-test"])
def test_rejected_proposals_never_advance_the_matcher(pair, method):
    target, draft = pair
    llm = LLM(target, draft=draft if method == "draft" else None, spec=SpecConfig(method=method, k=4))
    eng = llm.engine
    ForbiddenProposer.bad = eng.encode("zzq")  # never legal in SCHEMA's JSON
    spec = {"json_schema": json.dumps(SCHEMA)}
    seqs = [eng.add_request(f"r{i}", p, SamplingParams(temperature=1.0, max_tokens=30, seed=i,
                                                       structured_output=spec)) for i, p in enumerate(PROMPTS)]
    checked = 0
    while eng.has_unfinished():
        eng.step()
        for seq in seqs:
            fresh = GrammarState.create(eng.tokenizer, eng.vocab_size, eng.eos_ids, spec)
            for t in seq.output_ids:
                fresh.accept(t)
            assert same_state(seq.grammar, fresh, eng.vocab_size)
            checked += 1
    assert checked > len(seqs)
    for seq in seqs:
        assert seq.finish_reason == "stop" and matches("json_schema", seq.text), seq.text
    if method == "forbidden-test":
        assert eng.stats.proposed_tokens > 0 and eng.stats.accepted_tokens == 0


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_forced_tokens_are_proposed_and_accepted(llms, method):
    """JSON punctuation and the schema's fixed keys are forced: proposed without a draft forward
    (n-gram: whatever the history holds), and the target (under the same mask) accepts them."""
    llm = llms[method]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40,
                                                  structured_output={"json_schema": SCHEMA}))[0]
    assert matches("json_schema", out.text)
    # '{"ok": ', ', "kind": "' are forced (the n-gram alone accepts ~1.06 per round here)
    assert out.stats.mean_accepted_length > (2.0 if method == "draft" else 1.5)


def test_compiled_grammars_are_cached(llms):
    eng = llms["plain"].engine
    spec = {"regex": REGEX}
    a = compile_constraint(eng.tokenizer, eng.vocab_size, eng.eos_ids, spec)
    assert compile_constraint(eng.tokenizer, eng.vocab_size, eng.eos_ids, spec) is a


# ------------------------------------------------------------------ server and CLI
def test_server_structured_output(pair):
    target, draft = pair
    engine = LLM(target, draft=draft, spec=SpecConfig(method="draft", k=4)).engine
    with ServerThread(engine) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "describe add"}], max_tokens=48, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA}})
        assert r.choices[0].finish_reason == "stop" and matches("json_schema", r.choices[0].message.content)
        r = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=1.0, seed=3, n=3,
                                 extra_body={"guided_choice": CHOICE})
        assert len(r.choices) == 3 and all(ch.text in CHOICE for ch in r.choices)
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=64,
                                      temperature=0, response_format={"type": "json_object"})
        assert r.choices[0].message.content.startswith("{")
        r = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                 extra_body={"structured_outputs": {"regex": REGEX}})
        assert re.fullmatch(REGEX, r.choices[0].text)
        r = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=48, temperature=0,
                                 extra_body={"guided_json": SCHEMA})
        assert matches("json_schema", r.choices[0].text)
        bad = [
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": {"type": 5}}}},
             "response_format"),
            ({"guided_regex": "(ab"}, "guided_regex"),
            ({"guided_grammar": "root ::= foo"}, "guided_grammar"),
            ({"response_format": {"type": "xml"}}, "response_format"),
            ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
        ]
        for extra, param in bad:
            body = {"model": "tiny", "prompt": "x", "max_tokens": 4, **extra}
            resp = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
            assert resp.status_code == 400, (extra, resp.text)
            assert resp.json()["error"]["param"] == param, resp.json()
        # the lab's --url backend sends a workload line's constraint as `structured_outputs`
        from draftwise.lab.arrivals import LoadLevel
        from draftwise.lab.backends import HTTPBackend, sampling_params
        from draftwise.lab.workload import Request

        reqs = [Request("a", PROMPTS[0], 48, structured_output={"json_schema": json.dumps(SCHEMA)}),
                Request("b", PROMPTS[1], 16, structured_output={"choice": CHOICE})]
        out = HTTPBackend(srv.url).run(reqs, [[]] * 2, [sampling_params(r, 0) for r in reqs], LoadLevel("concurrency", 2))
        assert all(r.error is None for r in out.records), [r.error for r in out.records]
        assert matches("json_schema", out.records[0].text) and out.records[1].text in CHOICE


def test_cli_constraint_options(pair, tmp_path, capsys):
    target, _ = pair
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": 5}')
    for args in (["--json-schema", str(bad)], ["--regex", "(ab"], ["--choice", ","],
                 ["--grammar", str(tmp_path / "missing.ebnf")]):
        assert cli_main(["generate", "hi", "--model", target, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "error" in err, err
    good = tmp_path / "schema.json"
    good.write_text(json.dumps(SCHEMA))
    assert cli_main(["generate", "def f():", "--model", target, "--json-schema", str(good), "--json",
                     "--max-tokens", "48"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert matches("json_schema", out["text"])
    assert cli_main(["generate", "def f():", "--model", target, "--choice", "yes,no", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"] in ("yes", "no")



def test_workload_lines_carry_constraints(tmp_path):
    from draftwise.lab.backends import sampling_params
    from draftwise.lab.workload import load_workload

    p = tmp_path / "w.jsonl"
    p.write_text(json.dumps({"id": "a", "prompt": "x", "max_tokens": 8, "structured_output": {"choice": CHOICE}}) + "\n")
    wl = load_workload(str(p)).head(2)
    assert [r.structured_output for r in wl.requests] == [{"choice": CHOICE}] * 2
    assert sampling_params(wl.requests[1], seed=0).structured_output == {"choice": CHOICE}
    p.write_text(json.dumps({"id": "a", "prompt": "x", "max_tokens": 8, "structured_output": {"regex": "(a"}}) + "\n")
    with pytest.raises(ValueError, match=r"w.jsonl:1: structured_output.regex is invalid"):
        load_workload(str(p))


def test_lab_counts_valid_constrained_outputs(llms):
    from draftwise.lab.correctness import constraint_validity
    from draftwise.lab.metrics import RequestRecord
    from draftwise.lab.workload import Request

    eng = llms["plain"].engine
    spec = {"choice": CHOICE}
    reqs = [Request(str(i), "x", 8, structured_output=spec) for i in range(3)] + [Request("free", "x", 8)]
    yes = eng.encode("yes")
    recs = [RequestRecord("0", 0.0, token_ids=yes + eng.eos_ids[:1], finish_reason="stop"),
            RequestRecord("1", 0.0, token_ids=eng.encode("may"), finish_reason="length"),
            RequestRecord("2", 0.0, token_ids=eng.encode("yess"), finish_reason="stop"),
            RequestRecord("free", 0.0, token_ids=[5], finish_reason="length")]
    assert constraint_validity(eng, reqs, recs) == {"complete": 1, "valid_prefix": 1, "invalid": 1}
    assert constraint_validity(eng, reqs[3:], recs[3:]) is None


def test_grammar_time_is_counted(pair):
    target, draft = pair
    llm = LLM(target, draft=draft, spec=SpecConfig(method="draft", k=4))
    llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
    assert llm.engine.stats.grammar_seconds == 0.0
    llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=48, structured_output={"json_schema": SCHEMA}))
    st = llm.engine.stats
    assert 0.0 < st.grammar_seconds < st.propose_seconds + st.verify_seconds
    assert st.snapshot()["grammar_seconds"] == st.grammar_seconds
