"""The DSpark drafter in the engine (`--method dspark`, proposers/dspark.py): greedy output equal to
plain decoding at 1 and 16 in flight and under preemption, the drafter's cache equal to a fresh
computation over the committed tokens after rollbacks and recomputes, q in each DraftBlock the
Markov head's conditional on the drafted token before it, `draftwise check` PASS, a constrained
request, the dspark policy reading the confidence head, and bad input.

The drafter is random (few proposals accepted), so an oracle subclass (`test-dspark-oracle`) also
runs the drafter's forward but proposes the plain greedy continuation with one token corrupted at
a position that moves with the output: every accepted length 0..k occurs."""
import json
import random
import re
import shutil

import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.cli.main import main
from draftwise.lab.runner import parse_configs
from draftwise.model import load_model
from draftwise.model.config import ModelLoadError
from draftwise.policies import CostModel, StatelessPolicy, register_policy
from draftwise.model.dspark import DSparkDrafter, save_dspark
from draftwise.model.dspark_config import DSparkConfig
from draftwise.model.runner import ModelRunner
from draftwise.proposers import DraftBlock, register_proposer
from draftwise.proposers.dspark import DSparkProposer
from draftwise.sampling import process_logits
from draftwise.train.dspark import build_drafter
from drafter_checks import assert_equal_but_near_ties, assert_greedy_equals_plain, steps_checking
from test_dspark_policy import COST
from tiny_hybrid import make_hybrid_dir
from tiny_models import make_model_dir

ORACLE: dict[tuple, list[int]] = {}  # prompt -> the plain greedy output


@register_proposer("test-dspark-oracle")
class OracleDSpark(DSparkProposer):
    def propose(self, seqs, num_draft, num_forced=None):
        blocks = super().propose(seqs, num_draft, num_forced)  # the drafter's forward runs as ever
        for i, (s, b) in enumerate(zip(seqs, blocks)):
            plain = ORACLE.get(tuple(s.prompt_ids))
            if plain is None or not b.token_ids or not s.params.is_greedy:
                continue
            j = len(s.output_ids)
            n = len(b.token_ids)
            toks = list(plain[j : j + n]) + b.token_ids[len(plain[j : j + n]):]
            c = (3 * j + 1) % (n + 1)
            if c < n:
                toks[c] = (toks[c] + 1) % self.drafter.cfg.vocab_size
            blocks[i] = DraftBlock(toks, None, b.confidence)
        return blocks


def make_dspark_dir(path, target_dir, block_size=5, seed=0, markov_head_type="vanilla"):
    lm = load_model(target_dir, fuse=False, load_tokenizer=False)
    d = build_drafter(lm.config, lm.model, block_size, 8, [0, 1], seed, markov_head_type=markov_head_type)
    with torch.no_grad():  # a trained Markov head, mask vector and fc_in are not what they start as
        d.markov.w2.weight.normal_(0, 0.5)
        d.mask_embedding.normal_(0, 1.0)
        d.fc_in.weight.add_(torch.randn_like(d.fc_in.weight) * 0.05)
    save_dspark(d, path)
    return path


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory, target_dir):
    return make_dspark_dir(tmp_path_factory.mktemp("dspark"), target_dir)


@pytest.fixture(scope="module")
def plain(target_dir):
    llm = LLM(str(target_dir))
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    ps = [[rng.randrange(1, vocab) for _ in range(rng.randint(1, 30))] for _ in range(20)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(ps, sp)
    for p, o in zip(ps, outs):
        ORACLE[tuple(p)] = o.token_ids
    return llm, ps, sp, [o.token_ids for o in outs]


def decode_checking_drafter_cache(eng, ref, prompts, sp, multi, fresh):
    """Each prompt alone through `eng`: after every decode step the drafter's cache covers the
    committed positions and equals a fresh forward's (`fresh`); the output equals `ref`'s plain
    output (near-ties aside). `multi` (the spied multi-step calls) is cleared per request."""
    for i, p in enumerate(prompts):
        (w,) = ref.generate([p], sp)
        multi.clear()  # (plain decoding's own multi-step calls)
        seq = eng.add_request(f"r{i}", p, sp)
        while eng.has_unfinished():
            eng.step()
            if not seq.is_finished and not seq.is_prefilling:
                assert seq.draft_computed == seq.num_computed
                assert eng.proposer.cache_error(seq, fresh) <= 1e-4
        assert seq.finish_reason == "length" and seq.error is None, seq.error
        assert_equal_but_near_ties(ref.engine.target.model, [p], [seq.output_ids], [w.token_ids])


@pytest.mark.parametrize("method", ["dspark", "test-dspark-oracle"])
@pytest.mark.parametrize("seqs,blocks", [(1, None), (16, None), (16, 14)])
def test_greedy_equals_plain(target_dir, dspark_dir, plain, method, seqs, blocks):
    """c = 1 and 16; 14 blocks of 16 tokens for 16 sequences of up to 54 tokens: preemptions."""
    llm = LLM(str(target_dir), draft=str(dspark_dir), spec=SpecConfig(method=method, k=4), max_num_seqs=seqs,
              num_kv_blocks=blocks, max_model_len=64)
    st = assert_greedy_equals_plain(llm, plain, blocks)
    if method != "dspark":  # the oracle's corrupted position moves: accepted lengths 0..k occur
        assert 0 < st.accepted_tokens < st.proposed_tokens


def fresh_context(proposer, target, ids):
    """Each drafter layer's context K/V of `ids` from a fresh full target forward (no cache), and the
    fused features [1, n, H]."""
    d = proposer.drafter
    with torch.inference_mode():
        _, feats = target(torch.tensor([ids]), feature_layers=proposer.feature_layers)
        fused = d.fuse(feats)
        return d.context_kv(fused, torch.arange(len(ids))[None]), fused


def assert_cache_is_fresh(prop, fresh_target, seq):
    """The drafter's cached context K/V and fused features of `seq` equal a fresh forward's over its
    committed tokens, and the feature the next block reads is the last committed position's."""
    got, _, last = prop.context([seq.seq_id], [seq.draft_computed])
    fresh, fused = fresh_context(prop, fresh_target, seq.all_ids[: seq.num_computed])
    for (k, v), (fk, fv) in zip(got, fresh):
        assert (k - fk).abs().max() <= 1e-4 and (v - fv).abs().max() <= 1e-4
    slots = prop.slots.slots([seq.seq_id], [seq.draft_computed])[0]
    assert (prop.fused[slots] - fused[0]).abs().max() <= 1e-4
    assert torch.equal(last[0], prop.fused[slots[-1]])


@pytest.mark.parametrize("blocks", [None, 14])
def test_drafter_cache_equals_fresh_after_rollbacks(target_dir, dspark_dir, plain, blocks):
    """After rounds with rejections (and recomputes after preemption), the drafter's cache holds
    exactly the committed context: its length is the target's num_computed, its blocks no more
    than that needs, its K/V and fused features those of a fresh forward over the committed tokens,
    and the feature the next block reads is the last committed position's."""
    _, ps, _, _ = plain
    llm = LLM(str(target_dir), draft=str(dspark_dir), spec=SpecConfig(method="test-dspark-oracle", k=4),
              num_kv_blocks=blocks, max_model_len=64)
    eng = llm.engine
    prop = eng.proposer
    fresh_target = load_model(target_dir, fuse=False, load_tokenizer=False).model.eval()
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=30, ignore_eos=True)
              for i in range(len(ps))]
    seqs = [eng.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params))]

    def check(s):
        assert prop.kv is None and prop.slots is eng.runner.kv  # the target's slots
        assert_cache_is_fresh(prop, fresh_target, s)

    assert steps_checking(eng, seqs, 40, check) > 20
    st = eng.stats
    assert st.proposed_tokens > st.accepted_tokens > 0
    if blocks:
        assert st.preemptions > 0


def test_q_is_the_markov_heads_conditional_on_the_drafted_token(target_dir, dspark_dir):
    """DraftBlock.probs[k] = softmax(process_logits(U_k + B(x_{k-1}))) for the x_{k-1} drafted,
    recomputed from the block's hidden states; confidences are the head's c_k."""
    llm = LLM(str(target_dir), draft=str(dspark_dir), spec=SpecConfig(method="dspark", k=4))
    eng = llm.engine
    sp = SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.2, seed=1, max_tokens=40, ignore_eos=True)
    seq = eng.add_request("q", [5, 9, 2, 7, 11], sp)
    while seq.is_prefilling or seq.num_computed == 0:
        eng.step()
    prop = eng.proposer
    block = prop.propose([seq], [4])[0]
    assert len(block.token_ids) == 4 and block.probs.shape == (4, eng.vocab_size)
    d = prop.drafter
    with torch.inference_mode():
        kv, pos, last = prop.context([seq.seq_id], [seq.draft_computed])
        anchor = seq.all_ids[-1]
        hidden = d.block_hidden(torch.tensor([[anchor]]), torch.tensor([[seq.draft_computed]]), kv, pos,
                                last[:, None])[0, 0]
        base = d.head(hidden)  # [gamma, V]
        prev = [anchor] + block.token_ids
        state = d.markov.init_state(torch.tensor([anchor]))
        for k in range(4):
            state, bias = d.markov.step(state, torch.tensor([prev[k]]), hidden[k : k + 1])
            step = base[k : k + 1] + bias
            q = torch.softmax(process_logits(step, [sp], [seq.prompt_ids], [seq.output_ids + block.token_ids[:k]]), -1)
            assert torch.allclose(block.probs[k], q[0], atol=1e-6)
            assert block.probs[k, block.token_ids[k]] > 0
            c = torch.sigmoid(d.confidence_logit(hidden[k : k + 1], torch.tensor([prev[k]])))
            assert abs(block.confidence[k] - float(c)) < 1e-6
    # the Markov head makes q_2 depend on x_1: another x_1 gives another q_2
    bias = lambda x: d.markov.step(None, torch.tensor([x]), hidden[1:2])[1]  # noqa: E731 (vanilla: no state)
    assert not torch.allclose(bias((prev[1] + 1) % eng.vocab_size), bias(prev[1]))


@pytest.mark.parametrize("blocks", [None, 8])
def test_prefix_cache_hits_bring_the_drafters_rows(target_dir, dspark_dir, blocks):
    """The drafter's rows live at the target's slots: a request whose prompt shares whole blocks
    with an earlier one starts with the target's cached prefix and the drafter's rows of it (no
    forward over them), which equal a fresh forward's; greedy output equals plain decoding's, with
    preemptions too (8 blocks of 16 for 4 in flight)."""
    rng = random.Random(3)
    shared = [rng.randrange(1, 100) for _ in range(40)]  # two whole blocks of 16, and some
    ps = [shared + [rng.randrange(1, 100) for _ in range(rng.randint(1, 6))] for _ in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(target_dir)).generate(ps, sp)]
    llm = LLM(str(target_dir), draft=str(dspark_dir), spec=SpecConfig(method="test-dspark-oracle", k=4),
              num_kv_blocks=blocks, max_model_len=64, max_num_seqs=4)
    eng, prop = llm.engine, llm.engine.proposer
    assert eng.runner.kv.prefix_cache is not None and prop.kv is None and prop.slots is eng.runner.kv
    fresh_target = load_model(target_dir, fuse=False, load_tokenizer=False).model.eval()
    first = eng.add_request("warm", ps[0], sp)
    while eng.has_unfinished():
        eng.step()
    seqs = [eng.add_request(f"r{i}", p, sp) for i, p in enumerate(ps)]
    checked = 0
    while eng.has_unfinished():
        eng.step()
        for s in seqs:
            if s.is_finished or s.num_computed == 0:
                continue
            assert s.draft_computed == s.num_computed  # (a prefill chunk's rows are committed at once)
            got, _, _ = prop.context([s.seq_id], [s.draft_computed])
            fresh, _ = fresh_context(prop, fresh_target, s.all_ids[: s.num_computed])
            for (k, v), (fk, fv) in zip(got, fresh):
                assert (k - fk).abs().max() <= 1e-4 and (v - fv).abs().max() <= 1e-4
            checked += 1
    assert first.output_ids == want[0]
    assert [s.output_ids for s in seqs] == want
    assert eng.stats.prefix_cache_hit_tokens >= 32 * len(ps) and checked > 20
    assert eng.stats.proposed_tokens > 0
    if blocks:
        assert eng.stats.preemptions > 0


def test_a_steps_feature_rows_are_projected_in_one_product(target_dir, dspark_dir, plain, monkeypatch):
    """The target's feature rows of a step's sequences are fused and projected together
    (`stage_features`), one call a step however many rows commit; the committed rows are what a
    fresh forward gives (test_drafter_cache_equals_fresh_after_rollbacks checks the values)."""
    llm0, ps, sp, want = plain
    llm = LLM(str(target_dir), draft=str(dspark_dir), spec=SpecConfig(method="dspark", k=4), max_num_seqs=8)
    prop = llm.engine.proposer
    calls, staged = [], []
    fuse, read = prop.drafter.fuse, prop._staged
    monkeypatch.setattr(prop.drafter, "fuse", lambda x: calls.append(x.shape[1]) or fuse(x))
    monkeypatch.setattr(prop, "_staged", lambda seq, start, f: staged.append(read(seq, start, f)) or staged[-1])
    outs = llm.generate(ps[:8], sp)
    assert_equal_but_near_ties(llm0.engine.target.model, ps[:8], [o.token_ids for o in outs], want[:8])
    assert staged and all(s is not False for s in staged)  # every commit read the step's staged rows
    assert len(calls) <= llm.engine.stats.steps and max(calls) > 8  # one product a step, for several rows


def test_batched_blocks_equal_the_uncached_reference(target_dir, dspark_dir, plain):
    """One packed drafter forward for rows of different context lengths gives each row what
    `DSparkDrafter.propose` gives over a fresh forward of its whole committed context."""
    _, ps, _, _ = plain
    llm = LLM(str(target_dir), draft=str(dspark_dir), spec=SpecConfig(method="dspark", k=5))
    eng, prop = llm.engine, llm.engine.proposer
    fresh_target = load_model(target_dir, fuse=False, load_tokenizer=False).model.eval()
    seqs = [eng.add_request(f"b{i}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            for i, p in enumerate(ps[:6])]
    while any(s.num_computed == 0 or s.is_prefilling for s in seqs):
        eng.step()
    blocks = prop.propose(seqs, [5, 3, 5, 1, 4, 5])
    assert [len(b.token_ids) for b in blocks] == [5, 3, 5, 1, 4, 5]
    for s, b in zip(seqs, blocks):
        ctx = s.all_ids[: s.num_computed]
        with torch.inference_mode():
            _, feats = fresh_target(torch.tensor([ctx]), feature_layers=prop.feature_layers)
            ref = prop.drafter.propose(feats, torch.tensor([s.all_ids[-1]]))
        assert b.token_ids == ref.tokens[0, : len(b.token_ids)].tolist()
        assert torch.allclose(torch.tensor(b.confidence), ref.confidence[0, : len(b.token_ids)], atol=1e-5)


def test_check_passes(target_dir, dspark_dir, capsys):
    rc = main(["check", "--model", str(target_dir), "--method", "dspark", "--draft", str(dspark_dir), "--k", "4",
               "--samples", "300", "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("greedy equality", "distribution", "KV rollback", "stops inside accepted blocks"):
        assert f"PASS {name}" in out
    assert re.search(r"PASS KV rollback: .*, drafter [0-9.e+-]+ \(tolerance", out)  # its context K/V were compared


def test_dspark_policy_reads_the_confidences(target_dir, dspark_dir, plain):
    llm0, ps, sp, want = plain
    (cfg,) = [c for c in parse_configs("dspark:k=4:policy=dspark") if c.method]
    assert (cfg.method, cfg.k, cfg.policy) == ("dspark", 4, "dspark")
    # (a target step far dearer than the drafter's measured call here: the plan drafts)
    slow_target = CostModel((0.05,) + tuple(COST.target[1:]), COST.draft)
    llm = LLM(str(target_dir), draft=str(dspark_dir), spec=SpecConfig(method="test-dspark-oracle", k=4,
                                                                      policy="dspark", cost_model=slow_target))
    outs = llm.generate(ps[:16], sp)
    assert_equal_but_near_ties(llm0.engine.target.model, ps[:16], [o.token_ids for o in outs], want[:16])
    st = llm.engine.stats
    assert 0 < st.verified_tokens <= st.proposed_tokens


@register_policy("test-every-other-step")
class EveryOtherStep(StatelessPolicy):
    """Drafts on every other step only: the steps between are plain (a lone greedy row's: its
    scheduled tokens in one kernel call, `LLMEngine._multi_step`)."""

    def __init__(self, **_):
        self.steps = 0

    def plan(self, seqs, max_draft):
        self.steps += 1
        return [0 if self.steps % 2 else n for n in max_draft]

    def admit(self, seqs, blocks, draft_seconds):
        return [len(b.token_ids) for b in blocks]


@register_policy("test-announced-plain-steps")
class AnnouncedPlainSteps(EveryOtherStep):
    """EveryOtherStep that tells the scheduler its plain steps ahead (`plain_next`): it gives a lone
    greedy row up to `multi_step` tokens there."""

    def plain_next(self, num_seqs):
        return (self.steps + 1) % 2 == 1


@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory, tokenizer):
    """A target whose head is packed for the fused greedy steps (vocabulary 2048), and a drafter."""
    d = tmp_path_factory.mktemp("wide")
    target = make_model_dir(d / "target", seed=0, tokenizer=tokenizer, vocab_size=2048, layers=2, hidden=64)
    return target, make_dspark_dir(d / "dspark", target)


@pytest.mark.parametrize("policy", ["test-every-other-step", "test-announced-plain-steps", "dspark"])
def test_a_lone_row_with_plain_steps_keeps_the_features(wide_pair, plain, policy, monkeypatch):
    """A lone greedy row's plain steps, several tokens in one kernel call (`ModelRunner.greedy_steps`),
    hand the drafter the features of every committed token: its cache equals a fresh forward's
    after every step, and the output plain decoding's."""
    target, dspark = wide_pair
    _, ps, sp, _ = plain
    multi = []
    real = ModelRunner.greedy_steps

    def spy(self, *a, **kw):
        got = real(self, *a, **kw)
        multi.append(got is not None and len(got[0]) > 1 and len(got) == 3)
        return got

    monkeypatch.setattr(ModelRunner, "greedy_steps", spy)
    ref = LLM(str(target))
    llm = LLM(str(target), draft=str(dspark), spec=SpecConfig(method="dspark", k=4, policy=policy, cost_model=COST))
    fresh = load_model(target, fuse=False, load_tokenizer=False).model.eval()
    eng = llm.engine
    decode_checking_drafter_cache(eng, ref, ps[:4], sp, multi, fresh)
    st = eng.stats
    assert st.speculative_steps > 0
    if policy != "dspark":  # (dspark's choice reads measured step times: plain steps not certain)
        assert st.decode_steps > st.speculative_steps  # plain steps and drafting steps both ran
        assert any(multi)


def test_constrained_request(target_dir, dspark_dir, plain):
    """A choice constraint: greedy output equal to plain under it; sampled outputs obey it."""
    llm0 = plain[0]
    choice = {"choice": ["def", "class", "import os"]}
    llm = LLM(str(target_dir), draft=str(dspark_dir), spec=SpecConfig(method="dspark", k=4))
    prompts = ["def add(a, b):", "for i in", "import"]
    g = SamplingParams(temperature=0, max_tokens=16, structured_output=choice)
    assert [o.token_ids for o in llm.generate(prompts, g)] == [o.token_ids for o in llm0.generate(prompts, g)]
    s = SamplingParams(temperature=1.0, max_tokens=16, seed=3, structured_output=choice)
    for o in llm.generate(prompts * 3, s):
        assert o.finish_reason == "stop" and o.text in choice["choice"], o.text


def test_bad_input(tmp_path, tokenizer, target_dir, draft_dir, dspark_dir, capsys):
    with pytest.raises(ValueError, match="needs a DSpark drafter directory.*is a language model"):
        LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="dspark", k=4))
    with pytest.raises(ValueError, match="is a DSpark drafter, not a draft model: use --method dspark"):
        LLM(str(target_dir), draft=str(dspark_dir), spec=SpecConfig(method="draft", k=4))
    for change, match in (({"hidden_size": 32}, "differ from the target's"),
                          ({"target_feature_layers": [0, 5]}, "the target has 2 layers"),
                          ({"anchor_feature": "yes"}, "'anchor_feature': true or false, got 'yes'"),
                          ({"anchor_feature": False}, "tensor 'fc_in.weight' is not part of the drafter")):
        other = tmp_path / f"other{len(change)}{match[:4].strip(chr(39))}"
        shutil.copytree(dspark_dir, other)
        cfg = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ModelLoadError, match=f"{other.name}: not a DSpark drafter for the target.*{match}"):
            LLM(str(target_dir), draft=str(other), spec=SpecConfig(method="dspark", k=4))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["DSparkDrafter"], "vocab_size": 5}))
    with pytest.raises(ModelLoadError, match="broken: not a DSpark drafter.*'hidden_size' missing"):
        LLM(str(target_dir), draft=str(broken), spec=SpecConfig(method="dspark", k=4))
    hybrid = make_hybrid_dir(tmp_path / "hybrid", seed=5, tokenizer=tokenizer)
    cfg = DSparkConfig.for_target(load_model(hybrid, fuse=False, load_tokenizer=False).config, feature_layers=[0])
    save_dspark(DSparkDrafter(cfg), tmp_path / "hybrid-dspark")
    with pytest.raises(ValueError, match="reads an attention-only target's features; .* is a hybrid model"):
        LLM(str(hybrid), draft=str(tmp_path / "hybrid-dspark"), spec=SpecConfig(method="dspark", k=4))
    assert main(["generate", "--model", str(target_dir), "--method", "dspark", "--draft", str(draft_dir),
                 "x", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs a DSpark drafter directory" in err and "Traceback" not in err
    assert main(["generate", "--model", str(target_dir), "--method", "dspark", "x"]) == 2
    assert "needs a draft model directory" in capsys.readouterr().err


def test_generate_and_bench_from_the_command_line(tmp_path, target_dir, dspark_dir, capsys):
    assert main(["generate", "--model", str(target_dir), "--method", "dspark", "--draft", str(dspark_dir),
                 "--json", "--max-tokens", "6", "--ignore-eos", "def f():"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]
    assert stats["proposed_tokens"] > 0
    out = tmp_path / "bench"
    assert main(["bench", "--model", str(target_dir), "--draft", str(dspark_dir), "--configs", "none,dspark:k=4",
                 "--workload", "grounded", "--concurrency", "2", "--num-requests", "3", "--max-tokens", "8",
                 "--out", str(out), "--no-progress"]) == 0
    runs = json.loads((out / "results.json").read_text())["workloads"][0]["runs"]
    (spec,) = [r for r in runs if r["config"] == "dspark:k=4"]
    assert spec["method"] == "dspark" and spec["completed"] == 3 and spec["speculation"]["proposed_tokens"] > 0
    assert spec["correctness"]["compared"] == 3 and spec["correctness"]["mismatching_requests"] == 0
