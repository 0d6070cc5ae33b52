"""The EAGLE-3 drafter in the engine (`--method eagle3`, proposers/eagle3.py): greedy output equal to
plain decoding at 1 and 16 in flight and under preemption, the drafter's cache equal to a fresh
computation over the committed tokens after rollbacks and recomputes, batched drafting equal to the
uncached reference, the PyTorch path alone (kernels off) equal to plain (the kernel calls:
test_eagle3_kernels.py), q in each DraftBlock the processed distribution of each step, `draftwise check`
PASS, a constrained request, and bad input.

The drafter is random (few proposals accepted), so an oracle subclass (`test-eagle3-oracle`) also
runs the drafter's steps but proposes the plain greedy continuation with one token corrupted at a
position that moves with the output: every accepted length 0..k occurs."""
import json
import random
import re
import shutil

import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.cli.main import main
from draftwise.model import cpu_kernels, load_model
from draftwise.model.config import ModelLoadError
from draftwise.model.eagle3 import save_eagle3
from draftwise.proposers import DraftBlock, register_proposer
from draftwise.proposers.eagle3 import Eagle3Proposer
from draftwise.sampling import process_logits
from draftwise.train.eagle3 import build_drafter
from draftwise.model.runner import ModelRunner
from test_dspark_engine import AnnouncedPlainSteps  # noqa: F401 (registers its policy)
from test_dspark_engine import assert_equal_but_near_ties, decode_checking_drafter_cache, make_dspark_dir
from drafter_checks import assert_greedy_equals_plain, steps_checking
from tiny_models import make_model_dir

ORACLE: dict[tuple, list[int]] = {}  # prompt -> the plain greedy output


@register_proposer("test-eagle3-oracle")
class OracleEagle3(Eagle3Proposer):
    def propose(self, seqs, num_draft, num_forced=None):
        blocks = super().propose(seqs, num_draft, num_forced)  # the drafter's steps run as ever
        for i, (s, b) in enumerate(zip(seqs, blocks)):
            plain = ORACLE.get(tuple(s.prompt_ids))
            if plain is None or not b.token_ids or not s.params.is_greedy:
                continue
            j = len(s.output_ids)
            n = len(b.token_ids)
            toks = list(plain[j: j + n]) + b.token_ids[len(plain[j: j + n]):]
            c = (3 * j + 1) % (n + 1)
            if c < n:
                toks[c] = (toks[c] + 1) % self.drafter.cfg.vocab_size
            blocks[i] = DraftBlock(toks, None, b.confidence)
        return blocks


def make_eagle3_dir(path, target_dir, seed=0):
    lm = load_model(target_dir, fuse=False, load_tokenizer=False)
    d = build_drafter(lm.config, lm.model, 3, [0, 1], seed)
    with torch.no_grad():  # a trained fc_in is not the sum it starts as
        d.fc_in.weight.add_(torch.randn_like(d.fc_in.weight) * 0.05)
    save_eagle3(d, path)
    return path


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory, target_dir):
    return make_eagle3_dir(tmp_path_factory.mktemp("eagle3"), target_dir)


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


@pytest.mark.parametrize("method", ["eagle3", "test-eagle3-oracle"])
@pytest.mark.parametrize("seqs,blocks", [(1, None), (16, None), (16, 14)])
def test_greedy_equals_plain(target_dir, eagle3_dir, plain, method, seqs, blocks):
    """c = 1 and 16; 14 blocks of 16 tokens for 16 sequences of up to 54 tokens: preemptions."""
    llm = LLM(str(target_dir), draft=str(eagle3_dir), spec=SpecConfig(method=method, k=4), max_num_seqs=seqs,
              num_kv_blocks=blocks, max_model_len=64)
    assert llm.engine.runner.kv.prefix_cache is None  # (its rows read the next token: no prefix cache)
    st = assert_greedy_equals_plain(llm, plain, blocks)
    if method != "eagle3":  # the oracle's corrupted position moves: accepted lengths 0..k occur
        assert 0 < st.accepted_tokens < st.proposed_tokens


def fresh_rows(proposer, target, ids):
    """The context rows [1, n, H] and their K/V of `ids` (n + 1 tokens) from a fresh full target
    forward (no cache)."""
    d = proposer.drafter
    with torch.inference_mode():
        t = torch.tensor([ids])
        _, feats = target(t[:, :-1], feature_layers=proposer.feature_layers)
        rows = d.row_input(d.fuse(feats), t[:, 1:])
        return rows, d.kv(rows, torch.arange(len(ids) - 1)[None])


@pytest.mark.parametrize("policy", ["dspark", "goodput"])
def test_load_aware_policies_with_eagle3(target_dir, eagle3_dir, plain, policy):
    """Under a load-aware policy EAGLE-3's drafting, which no profile times, is priced as the
    engine measures it (the dspark policy's `block_drafter`: `BlockCost` sees its rounds); greedy
    output equals plain decoding's, one request at a time."""
    from draftwise.policies import CostModel
    from policy_helpers import COST

    llm0, ps, sp, want = plain
    cost = CostModel((0.05,) + tuple(COST.target[1:]), COST.draft)  # (learned online towards the real steps)
    llm = LLM(str(target_dir), draft=str(eagle3_dir), spec=SpecConfig(method="test-eagle3-oracle", k=4,
                                                                      policy=policy, cost_model=cost))
    outs = [llm.generate([p], sp)[0] for p in ps[:6]]
    assert_equal_but_near_ties(llm0.engine.target.model, ps[:6], [o.token_ids for o in outs], want[:6])
    assert llm.engine.stats.proposed_tokens > 0
    if policy == "dspark":
        assert llm.engine.policy.core.block is not None and llm.engine.policy.core.block.seen > 0


@pytest.mark.parametrize("blocks", [None, 14])
def test_drafter_cache_equals_fresh_after_rollbacks(target_dir, eagle3_dir, plain, blocks):
    """After rounds with rejections (and recomputes after preemption), the drafter's cache holds
    exactly the committed context: its length is the target's num_computed, its blocks no more
    than that needs, its rows and K/V those of a fresh forward over the committed tokens."""
    _, ps, _, _ = plain
    llm = LLM(str(target_dir), draft=str(eagle3_dir), spec=SpecConfig(method="test-eagle3-oracle", k=4),
              num_kv_blocks=blocks, max_model_len=64)
    eng = llm.engine
    prop = eng.proposer
    fresh_target = load_model(target_dir, fuse=False, load_tokenizer=False).model.eval()
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=30, ignore_eos=True)
              for i in range(len(ps))]
    seqs = [eng.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params))]

    def check(s):
        n = s.draft_computed
        assert len(prop.kv.tables[s.seq_id]) == -(-n // prop.kv.block_size)
        k, v, _, last = prop.context([s.seq_id], [n])
        rows, (fk, fv) = fresh_rows(prop, fresh_target, s.all_ids[: n + 1])
        assert (k - fk).abs().max() <= 1e-4 and (v - fv).abs().max() <= 1e-4
        assert (last[0] - rows[0, -1]).abs().max() <= 1e-4  # the next round's step 1
        assert prop.cache_error(s, fresh_target) <= 1e-4

    assert steps_checking(eng, seqs, 40, check) > 20
    st = eng.stats
    assert st.proposed_tokens > st.accepted_tokens > 0
    if blocks:
        assert st.preemptions > 0


def test_batched_steps_equal_the_uncached_reference(target_dir, eagle3_dir, plain):
    """One forward per step for rows of different context lengths gives each row what
    `Eagle3Drafter.propose` gives over a fresh forward of its whole committed context, and the
    training-time test unroll, fed the drafted tokens, gives the same steps' argmax."""
    _, ps, _, _ = plain
    llm = LLM(str(target_dir), draft=str(eagle3_dir), spec=SpecConfig(method="eagle3", k=5))
    eng, prop = llm.engine, llm.engine.proposer
    fresh_target = load_model(target_dir, fuse=False, load_tokenizer=False).model.eval()
    seqs = [eng.add_request(f"b{i}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            for i, p in enumerate(ps[:6])]
    while any(s.num_computed == 0 or s.is_prefilling for s in seqs):
        eng.step()
    blocks = prop.propose(seqs, [5, 3, 5, 1, 4, 5])
    assert [len(b.token_ids) for b in blocks] == [5, 3, 5, 1, 4, 5]
    d = prop.drafter
    for s, b in zip(seqs, blocks):
        ids = s.all_ids
        n = len(ids) - 1
        with torch.inference_mode():
            _, feats = fresh_target(torch.tensor([ids[:n]]), feature_layers=prop.feature_layers)
            ref = d.propose(feats, torch.tensor([ids]), 5)
            assert b.token_ids == ref.tokens[0, : len(b.token_ids)].tolist()
            q = torch.softmax(ref.logits[0], -1)  # [5, V]
            assert torch.allclose(torch.tensor(b.confidence), q.amax(-1)[: len(b.token_ids)], atol=1e-5)
            # unroll over the window (context + drafted tokens): row n-1's step j is the round's step j
            window = torch.tensor([ids + ref.tokens[0].tolist()])
            _, wf = fresh_target(window, feature_layers=prop.feature_layers)
            steps = d.unroll(wf, window, 5)
            got = [int(steps[j][0, n - 1].argmax()) for j in range(5)]
            assert got == ref.tokens[0].tolist()
            assert torch.allclose(torch.stack([steps[j][0, n - 1] for j in range(5)]), ref.logits[0], atol=1e-4)



def test_greedy_equals_plain_without_the_kernels(target_dir, eagle3_dir, plain):
    """With the CPU kernels off the drafter steps through PyTorch (`Eagle3Drafter.draft`) and greedy
    output stays plain decoding's, at 16 in flight with preemptions."""
    llm0, ps, sp, want = plain
    cpu_kernels.set_enabled(False)
    try:
        llm = LLM(str(target_dir), draft=str(eagle3_dir), spec=SpecConfig(method="eagle3", k=4), max_num_seqs=16,
                  num_kv_blocks=14, max_model_len=64)
        assert llm.engine.proposer.kernel is None
        outs = llm.generate(ps, sp)
    finally:
        cpu_kernels.set_enabled(True)
    assert_equal_but_near_ties(llm0.engine.target.model, ps, [o.token_ids for o in outs], want)
    assert llm.engine.stats.preemptions > 0 and llm.engine.stats.proposed_tokens > 0


def test_q_is_each_steps_processed_distribution(target_dir, eagle3_dir):
    """DraftBlock.probs[j] = softmax(process_logits(step j's logits)) with penalties over the tokens
    drafted before j; the drafted token has q > 0; confidences are max q."""
    llm = LLM(str(target_dir), draft=str(eagle3_dir), spec=SpecConfig(method="eagle3", k=4))
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
        k, v, pos, last = prop.context([seq.seq_id], [seq.draft_computed])
        start = torch.tensor([seq.draft_computed - 1])
        forced = iter(block.token_ids)
        ref = d.draft(last, start, k, v, pos < start[:, None], 4, lambda j, logits: torch.tensor([next(forced)]))
    for j in range(4):
        q = torch.softmax(process_logits(ref.logits[0, j: j + 1], [sp], [seq.prompt_ids],
                                         [seq.output_ids + block.token_ids[:j]]), -1)[0]
        assert torch.allclose(block.probs[j], q, atol=1e-6)
        assert block.probs[j, block.token_ids[j]] > 0
        assert abs(block.confidence[j] - float(q.max())) < 1e-6


def test_check_passes(target_dir, eagle3_dir, capsys):
    rc = main(["check", "--model", str(target_dir), "--method", "eagle3", "--draft", str(eagle3_dir), "--k", "4",
               "--samples", "300", "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("greedy equality", "distribution", "KV rollback", "stops inside accepted blocks"):
        assert f"PASS {name}" in out
    assert re.search(r"PASS KV rollback: .*, drafter [0-9.e+-]+ \(tolerance", out)  # its cache was compared


def test_constrained_request(target_dir, eagle3_dir, plain):
    """A choice constraint: greedy output equal to plain under it; sampled outputs obey it."""
    llm0 = plain[0]
    choice = {"choice": ["def", "class", "import os"]}
    llm = LLM(str(target_dir), draft=str(eagle3_dir), spec=SpecConfig(method="eagle3", k=4))
    prompts = ["def add(a, b):", "for i in", "import"]
    g = SamplingParams(temperature=0, max_tokens=16, structured_output=choice)
    assert [o.token_ids for o in llm.generate(prompts, g)] == [o.token_ids for o in llm0.generate(prompts, g)]
    s = SamplingParams(temperature=1.0, max_tokens=16, seed=3, structured_output=choice)
    for o in llm.generate(prompts * 3, s):
        assert o.finish_reason == "stop" and o.text in choice["choice"], o.text


def test_bad_input(tmp_path, target_dir, draft_dir, eagle3_dir, capsys):
    with pytest.raises(ValueError, match="needs an EAGLE-3 drafter directory.*is a language model"):
        LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="eagle3", k=4))
    with pytest.raises(ValueError, match="is an EAGLE-3 drafter, not a draft model: use --method eagle3"):
        LLM(str(target_dir), draft=str(eagle3_dir), spec=SpecConfig(method="draft", k=4))
    with pytest.raises(ValueError, match="needs a DSpark drafter directory.*is an EAGLE-3 drafter: use --method eagle"):
        LLM(str(target_dir), draft=str(eagle3_dir), spec=SpecConfig(method="dspark", k=4))
    dspark = make_dspark_dir(tmp_path / "dspark", target_dir)
    with pytest.raises(ValueError, match="needs an EAGLE-3 drafter directory.*is a DSpark drafter: use --method"):
        LLM(str(target_dir), draft=str(dspark), spec=SpecConfig(method="eagle3", k=4))
    for i, (change, match) in enumerate((({"hidden_size": 32}, "differ from the target's"),
                                         ({"target_feature_layers": [0, 5]}, "the target has 2 layers"),
                                         ({"target_feature_layers": [1, 0]}, "strictly increasing"),
                                         ({"steps": 0}, "'steps': an integer >= 1, got 0"),
                                         ({"intermediate_size": 64}, "tensor 'layer.gate_proj.weight' missing or of "
                                                                     "another shape"))):
        other = tmp_path / f"other{i}"
        shutil.copytree(eagle3_dir, other)
        cfg = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ModelLoadError, match=f"{other.name}: not an EAGLE-3 drafter for the target.*{match}"):
            LLM(str(target_dir), draft=str(other), spec=SpecConfig(method="eagle3", k=4))
    extra = tmp_path / "extra"
    shutil.copytree(eagle3_dir, extra)
    from safetensors.torch import load_file, save_file
    state = load_file(str(extra / "model.safetensors"))
    save_file({**state, "mask_embedding": torch.zeros(64)}, str(extra / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="tensor 'mask_embedding' is not part of the drafter"):
        LLM(str(target_dir), draft=str(extra), spec=SpecConfig(method="eagle3", k=4))
    missing = tmp_path / "missing"
    shutil.copytree(eagle3_dir, missing)
    (missing / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors: not found"):
        LLM(str(target_dir), draft=str(missing), spec=SpecConfig(method="eagle3", k=4))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["Eagle3Drafter"], "vocab_size": 5}))
    with pytest.raises(ModelLoadError, match="broken: not an EAGLE-3 drafter.*'hidden_size' missing"):
        LLM(str(target_dir), draft=str(broken), spec=SpecConfig(method="eagle3", k=4))
    assert main(["generate", "--model", str(target_dir), "--method", "eagle3", "--draft", str(draft_dir),
                 "x", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs an EAGLE-3 drafter directory" in err and "Traceback" not in err
    assert main(["generate", "--model", str(target_dir), "--method", "eagle3", "--draft", str(broken),
                 "x", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "'hidden_size' missing" in err and "Traceback" not in err


def test_generate_and_bench_from_the_command_line(tmp_path, target_dir, eagle3_dir, capsys):
    assert main(["generate", "--model", str(target_dir), "--method", "eagle3", "--draft", str(eagle3_dir),
                 "--json", "--max-tokens", "6", "--ignore-eos", "def f():"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]
    assert stats["proposed_tokens"] > 0
    out = tmp_path / "bench"
    assert main(["bench", "--model", str(target_dir), "--draft", str(eagle3_dir), "--configs", "none,eagle3:k=4",
                 "--workload", "grounded", "--concurrency", "2", "--num-requests", "3", "--max-tokens", "8",
                 "--out", str(out), "--no-progress"]) == 0
    runs = json.loads((out / "results.json").read_text())["workloads"][0]["runs"]
    (spec,) = [r for r in runs if r["config"] == "eagle3:k=4"]
    assert spec["method"] == "eagle3" and spec["completed"] == 3 and spec["speculation"]["proposed_tokens"] > 0
    assert spec["correctness"]["compared"] == 3 and spec["correctness"]["mismatching_requests"] == 0


def test_a_lone_row_with_multi_step_plain_steps_keeps_the_features(tmp_path, tokenizer, plain, monkeypatch):
    """A lone greedy row's plain steps, several tokens in one kernel call (`ModelRunner.greedy_steps`,
    on a target whose head the fused steps take), hand the drafter the features of every committed
    token: its cache equals a fresh forward's after every step, and the output plain decoding's."""
    target = make_model_dir(tmp_path / "target", seed=0, tokenizer=tokenizer, vocab_size=2048, layers=2, hidden=64)
    eagle3 = make_eagle3_dir(tmp_path / "eagle3", target)
    _, ps, sp, _ = plain
    multi = []
    real = ModelRunner.greedy_steps

    def spy(self, *a, **kw):
        got = real(self, *a, **kw)
        multi.append(got is not None and len(got[0]) > 1 and len(got) == 3)
        return got

    monkeypatch.setattr(ModelRunner, "greedy_steps", spy)
    ref = LLM(str(target))
    llm = LLM(str(target), draft=str(eagle3), spec=SpecConfig(method="eagle3", k=4, policy="test-announced-plain-steps"))
    fresh = load_model(target, fuse=False, load_tokenizer=False).model.eval()
    eng = llm.engine
    decode_checking_drafter_cache(eng, ref, ps[:4], sp, multi, fresh)
    st = eng.stats
    assert 0 < st.speculative_steps < st.decode_steps
    assert any(multi)
