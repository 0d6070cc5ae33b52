"""Structured output under speculation (xgrammar): every output matches its constraint, greedy
speculative == greedy plain under the same constraint, the constrained distribution is kept at
T=1, proposals (accepted or rejected) never advance a sequence's matcher, and invalid constraints
are clear errors (ValueError, HTTP 400, CLI exit 2).

The models here use a byte-level BPE with the full byte alphabet (JSON punctuation has tokens).
"""
import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch
from scipy.stats import chi2_contingency
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.cli.main import main as cli_main
from draftwise.proposers import DraftBlock
from draftwise.proposers.base import register_proposer
from draftwise.sampling import process_logits
from draftwise.sampling.grammar import GrammarState, allowed_from_bitmask, compile_constraint
from server_harness import ServerThread
from tiny_models import CORPUS, make_model_dir

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["add", "sub", "mul"]}},
    "required": ["ok", "kind"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,5}x"
CHOICE = ["yes", "no", "maybe so"]
CONSTRAINTS = {"choice": {"choice": CHOICE}, "regex": {"regex": REGEX}, "json_schema": {"json_schema": SCHEMA}}
PROMPTS = ["def add(a, b):", "import os", "class Point:", "for i in"]


def matches(kind: str, text: str) -> bool:
    if kind == "choice":
        return text in CHOICE
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS + ['{"ok": true, "kind": "add"}', '{"name": "f", "args": [1, 2]}'] * 5, trainer)
    d = tmp_path_factory.mktemp("so")
    target = make_model_dir(d / "target", seed=0, tokenizer=tok, layers=2, hidden=64)
    draft = make_model_dir(d / "draft", seed=1, tokenizer=tok, layers=1, hidden=32, heads=2, kv_heads=1, inter=64)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def llms(pair):
    target, draft = pair
    return {
        "plain": LLM(target),
        "draft": LLM(target, draft=draft, spec=SpecConfig(method="draft", k=4)),
        "ngram": LLM(target, spec=SpecConfig(method="ngram", k=4)),
    }


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
