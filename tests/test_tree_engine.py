"""Tree verification through the engine (`--method draft --tree W`): greedy output equals plain
greedy output, a sampled tree config passes the exactness suite, and after rounds with rejected
branches the target's and the drafter's caches equal a fresh prefill of the committed tokens."""
import random

import pytest
import torch

import draftwise.engine.engine as engine_module
from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.engine import EngineConfig, LLMEngine
from draftwise.lab.check import CheckSetup, check_distribution, make_engine
from draftwise.model import cpu_kernels, load_model
from draftwise.model.llama import LlamaModel
from tiny_models import make_model_dir


@pytest.fixture(scope="module")
def near_draft_dir(tmp_path_factory, tokenizer):
    """The target's weights plus noise: it agrees with the target often, not always (branches pay)."""
    return make_model_dir(tmp_path_factory.mktemp("near-draft"), seed=0, tokenizer=tokenizer, perturb=0.15)


def prompts(vocab: int, n: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(2, 24))] for _ in range(n)]


@pytest.mark.parametrize("n,fused", [(1, True), (16, True), (6, False)])
def test_greedy_tree_equals_plain(target_dir, near_draft_dir, monkeypatch, n, fused):
    """fused: greedy rows draft a spine with runners-up in one kernel call; else depth by depth."""
    paths = []
    keep = engine_module.keep_accepted_path

    def spy(runner, seq_id, n_before, path):
        paths.append(list(path or []))
        keep(runner, seq_id, n_before, path)

    monkeypatch.setattr(engine_module, "keep_accepted_path", spy)
    fused_trees = []
    decoder_args = LlamaModel._decoder_args

    def spy_args(self, B, T, pos_ptr, kv_cache, meta, max_position):
        fused_trees.append(meta.kernel_trees is not None)
        return decoder_args(self, B, T, pos_ptr, kv_cache, meta, max_position)

    monkeypatch.setattr(LlamaModel, "_decoder_args", spy_args)
    plain = LLM(str(target_dir))
    ps = prompts(plain.engine.vocab_size, n)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = plain.generate(ps, sp)
    llm = LLM(str(target_dir), draft=str(near_draft_dir), spec=SpecConfig(method="draft", k=6, tree=3),
              draft_dtype="float32")
    llm.engine.proposer.fused_steps = fused
    outs = llm.generate(ps, sp)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert sum(o.stats.accepted_tokens for o in outs) > 0
    # some accepted path left the main chain (a sibling won), else the tree did nothing a chain would not
    assert any(p and p != list(range(len(p))) for p in paths) or n == 1
    # the target's tree steps and the drafter's ran on the fused kernels where they are built
    assert any(fused_trees) or cpu_kernels.kernels() is None


def test_sampled_tree_passes_the_distribution_check(target_dir, near_draft_dir):
    target = load_model(target_dir)
    draft = load_model(near_draft_dir, load_tokenizer=False)
    s = CheckSetup(target, draft, SpecConfig(method="draft", k=4, tree=2), prompts(target.config.vocab_size, 4),
                   temperature=1.0, samples=300, horizon=3, dist_prompts=2)
    plain = make_engine(s, SpecConfig())
    res = check_distribution(s, plain, make_engine(s))
    assert res.passed, res.detail
    assert res.figures  # (the check measured something)


def test_tree_rollback_matches_fresh_prefill(target_dir, near_draft_dir):
    target = load_model(target_dir)
    draft = load_model(near_draft_dir, load_tokenizer=False)
    engine = LLMEngine(target, draft, SpecConfig(method="draft", k=5, tree=2), EngineConfig(block_size=4))
    seqs = [engine.add_request(f"r{i}", list(range(3 + i, 12 + 2 * i)),
                               SamplingParams(temperature=t, seed=i, max_tokens=40, ignore_eos=True))
            for i, t in enumerate([0.0, 1.0, 0.0, 0.8])]
    for _ in range(6):
        engine.step()
    for seq in seqs:
        assert seq.stats.proposed_tokens > seq.stats.accepted_tokens, "expected rejected nodes"
        ids = seq.all_ids
        assert seq.num_computed == len(ids) - 1
        with torch.no_grad():
            fresh_p = target.model.logits(torch.tensor([ids]))[0, -1]
            fresh_q = draft.model.logits(torch.tensor([ids]))[0, -1]
        for runner, computed, fresh in ((engine.runner, seq.num_computed, fresh_p),
                                        (engine.proposer.runner, seq.draft_computed, fresh_q)):
            runner.kv.reserve(seq.seq_id, len(ids))
            got = runner.run([seq.seq_id], [ids[computed:]], [computed], [1])[0]
            assert (got - fresh).abs().max() <= 1e-4


def test_a_tree_for_a_drafter_without_trees_is_refused():
    with pytest.raises(ValueError, match="tree needs --method draft, suffix, dspark or eagle3"):
        SpecConfig(method="ngram", k=4, tree=2)
    with pytest.raises(ValueError, match="tree needs --method draft, suffix, dspark or eagle3"):
        SpecConfig(method="none", tree=2)
