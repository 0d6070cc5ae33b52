"""DSpark's sequential stage (model/dspark_heads.py): each head kind drafted left to right equals
its teacher-forced block; what each position reads of the tokens drafted before it; the config's
head type; and rnn- and mlp-headed drafters in the engine (greedy equal to plain)."""
import json

import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.lab import correctness
from draftwise.model import load_model
from draftwise.model.dspark import DSparkDrafter, load_dspark, save_dspark
from draftwise.model.dspark_config import DSparkConfig
from draftwise.model.dspark_heads import HEAD_TYPES, make_head
from draftwise.train.dspark import build_drafter

LAYERS = [0, 1]


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, fuse=False, load_tokenizer=False).model.eval()


def make_drafter(target, kind, seed=0, block_size=4) -> DSparkDrafter:
    torch.manual_seed(seed)
    cfg = DSparkConfig.for_target(target.cfg, block_size=block_size, markov_rank=8, feature_layers=LAYERS,
                                  markov_head_type=kind)
    d = DSparkDrafter(cfg).share(target)
    with torch.no_grad():  # a trained head: W2 and the gate / recurrence away from their start
        for p in d.markov.parameters():
            p.add_(torch.randn_like(p) * 0.5)
        d.mask_embedding.normal_(0, 1.0)
    return d.eval()


def block_of(d, target, ids):
    with torch.no_grad():
        _, feats = target(ids, feature_layers=tuple(LAYERS))
        pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
        fused = d.fuse(feats)
        anchor_pos = torch.full((ids.shape[0], 1), ids.shape[1])
        return feats, d.block_hidden(ids[:, -1:], anchor_pos, d.context_kv(fused, pos), pos, fused[:, -1:])[:, 0]


@pytest.mark.parametrize("kind", HEAD_TYPES)
@pytest.mark.parametrize("prepared", [False, True], ids=["plain", "prepared"])
def test_drawn_left_to_right_equals_the_teacher_forced_block(target, kind, prepared):
    """Drafting the tokens x_1..x_gamma one by one gives, at every position, the logits and
    confidence that training computes for the block with those tokens as its history."""
    d = make_drafter(target, kind)
    if prepared:
        d.prepare()
    ids = torch.randint(1, target.cfg.vocab_size, (3, 9))
    feats, hidden = block_of(d, target, ids)
    forced = torch.randint(1, target.cfg.vocab_size, (3, 4))
    with torch.no_grad():
        out = d.propose(feats, ids[:, -1], choose=lambda k, lg: forced[:, k])
        prev = torch.cat((ids[:, -1:], forced[:, :-1]), 1)  # [3, gamma]: the anchor, then x_1..x_{gamma-1}
        logits, conf = d.teacher_forced(hidden[:, None], prev[:, None])
    assert torch.equal(out.tokens, forced)
    assert torch.allclose(out.logits, logits[:, 0], atol=1e-4)
    assert torch.allclose(out.confidence, torch.sigmoid(conf[:, 0]), atol=1e-5)


@pytest.mark.parametrize("kind,reads_earlier", [("vanilla", False), ("gated", False), ("rnn", True), ("mlp", False)])
def test_what_a_position_reads_of_the_tokens_drafted_before(target, kind, reads_earlier):
    """Position 3's q reads x_2 under every head; x_1 only through the rnn head's state. Positions
    before the changed token do not move."""
    d = make_drafter(target, kind)
    ids = torch.randint(1, target.cfg.vocab_size, (1, 8))
    feats, _ = block_of(d, target, ids)
    with torch.no_grad():
        base = d.propose(feats, ids[:, -1], choose=lambda k, lg: torch.full((1,), 5 + k))
        x1 = d.propose(feats, ids[:, -1], choose=lambda k, lg: torch.full((1,), 77 if k == 0 else 5 + k))
        x2 = d.propose(feats, ids[:, -1], choose=lambda k, lg: torch.full((1,), 77 if k == 1 else 5 + k))
    assert torch.equal(base.logits[:, :2], x2.logits[:, :2])
    assert not torch.allclose(base.logits[:, 2], x2.logits[:, 2])  # q_3 reads x_2
    assert torch.allclose(base.logits[:, 2], x1.logits[:, 2]) != reads_earlier  # and x_1: rnn only


def test_a_fresh_head_leaves_the_base_logits_and_the_type_round_trips(target, tmp_path):
    for kind in HEAD_TYPES:
        head = make_head(kind, target.cfg.vocab_size, 8, target.cfg.hidden_size)
        bias = head.block(torch.randint(0, 100, (2, 3)), torch.randn(2, 3, target.cfg.hidden_size))
        assert bias.shape == (2, 3, target.cfg.vocab_size) and not bias.any()  # W2 starts at zero
        h = torch.randn(2, 3, target.cfg.hidden_size)
        assert torch.equal(head.adjust(h, torch.randn_like(h)), h)  # mlp: its output projection starts at zero
    d = make_drafter(target, "rnn")
    save_dspark(d, tmp_path / "d")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["markov_head_type"] == "rnn"
    back = load_dspark(tmp_path / "d", target)
    assert back.markov.kind == "rnn" and set(back.state_dict()) == set(d.state_dict())
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    del cfg["markov_head_type"]  # a directory from before head types: vanilla
    assert DSparkConfig.from_dict(cfg).markov_head_type == "vanilla"
    cfg["markov_head_type"] = "lstm"
    with pytest.raises(ValueError, match="markov_head_type.*vanilla, gated, rnn.*'lstm'"):
        DSparkConfig.from_dict(cfg)
    cfg["markov_head_type"], cfg["causal_block"] = "rnn", "yes"
    with pytest.raises(ValueError, match="'causal_block': true or false, got 'yes'"):
        DSparkConfig.from_dict(cfg)
    with pytest.raises(ValueError, match="markov head type 'lstm'"):
        make_head("lstm", 10, 4, 8)


@pytest.fixture(scope="module", params=["rnn", "mlp"])
def head_dir(request, tmp_path_factory, target_dir):
    lm = load_model(target_dir, fuse=False, load_tokenizer=False)
    d = build_drafter(lm.config, lm.model, 5, 8, LAYERS, 0, markov_head_type=request.param)
    with torch.no_grad():  # a trained head and mask vector are not what they start as
        for p in d.markov.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        d.mask_embedding.normal_(0, 1.0)
    out = tmp_path_factory.mktemp(f"dspark_{request.param}")
    save_dspark(d, out)
    return out


@pytest.mark.parametrize("seqs", [1, 16])
def test_a_head_with_state_or_hidden_in_the_engine_greedy_equals_plain(target_dir, head_dir, seqs):
    prompts = [[5, 9, 2, 7, 11], [3, 3, 8], [12, 40, 41, 42, 43, 44], [6]]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(target_dir))
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    llm = LLM(str(target_dir), draft=str(head_dir), spec=SpecConfig(method="dspark", k=4), max_num_seqs=seqs)
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    for p, g, w in zip(prompts, got, want):  # equal, but where the target's top two tie within float noise
        j = correctness.first_difference(w, g)
        assert j is None or (j < len(w) and correctness.near_tie(plain.engine.target.model, p + w, len(p) + j))
    assert llm.engine.stats.proposed_tokens > 0
