"""The DSpark drafter (model/dspark.py) and the target's features it reads (model/llama.py,
model/runner.py): shapes, the Markov head's left-to-right dependence, the saved directory's round
trip, and features equal to the hidden states of a plain forward on every path."""
import json

import pytest
import torch

from draftwise.model import load_model
from draftwise.model.dspark import DSparkDrafter, load_dspark, save_dspark
from draftwise.model.dspark_config import DSparkConfig, default_feature_layers
from draftwise.model.runner import ModelRunner

LAYERS = (0, 1)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, fuse=False, load_tokenizer=False).model.eval()


def make_drafter(target, block_size=4, rank=8, seed=0, anchor_feature=True) -> DSparkDrafter:
    torch.manual_seed(seed)
    cfg = DSparkConfig.for_target(target.cfg, block_size=block_size, markov_rank=rank, feature_layers=list(LAYERS),
                                  anchor_feature=anchor_feature)
    d = DSparkDrafter(cfg).share(target)
    with torch.no_grad():  # a trained head is not zero: give W2, the mask vector and fc_in values
        d.markov.w2.weight.normal_(0, 0.5)
        d.mask_embedding.normal_(0, 1.0)
        if d.fc_in is not None:
            d.fc_in.weight.add_(torch.randn_like(d.fc_in.weight) * 0.05)
    return d.eval()


def test_default_feature_layers_low_middle_high_last():
    assert default_feature_layers(8) == [1, 4, 6, 7]
    assert default_feature_layers(36) == [1, 18, 34, 35]
    assert default_feature_layers(3) == [1, 2]
    assert default_feature_layers(2) == [0, 1] and default_feature_layers(1) == [0]


def test_block_shapes_and_confidence_range(target):
    d = make_drafter(target)
    ids = torch.randint(1, target.cfg.vocab_size, (3, 10))
    with torch.no_grad():
        _, feats = target(ids, feature_layers=LAYERS)
        out = d.propose(feats, ids[:, -1])
    V = target.cfg.vocab_size
    assert feats.shape == (3, 10, 2 * target.cfg.hidden_size)
    assert out.tokens.shape == (3, 4) and out.logits.shape == (3, 4, V) and out.confidence.shape == (3, 4)
    assert ((out.confidence > 0) & (out.confidence < 1)).all()
    assert torch.equal(out.tokens, out.logits.argmax(-1))  # greedy: each x_k the argmax of its own q_k


def test_markov_head_reads_the_token_drafted_before(target):
    """q_k = softmax(U_k + W1[x_{k-1}] W2): the bias at k follows the token chosen at k-1; earlier
    positions and the parallel backbone do not move."""
    d = make_drafter(target)
    ids = torch.randint(1, target.cfg.vocab_size, (1, 8))
    with torch.no_grad():
        _, feats = target(ids, feature_layers=LAYERS)
        a = d.propose(feats, ids[:, -1], choose=lambda k, lg: torch.full((1,), 5 + k))
        b = d.propose(feats, ids[:, -1], choose=lambda k, lg: torch.full((1,), 5 + k if k != 1 else 77))
        pos = torch.arange(8)[None]
        fused = d.fuse(feats)
        hidden = d.block_hidden(ids[:, -1:], torch.tensor([[8]]), d.context_kv(fused, pos), pos, fused[:, -1:])[:, 0]
        base = d.head(hidden)  # [1, gamma, V]
        w = d.markov.w2.weight @ d.markov.w1.weight.T  # [V, V]: column x is B(x, .)
    assert torch.equal(a.logits[:, :2], b.logits[:, :2])
    assert not torch.allclose(a.logits[:, 2], b.logits[:, 2])  # x_2's q reads x_1 (6 vs 77)
    assert torch.equal(a.logits[:, 3], b.logits[:, 3])  # x_3 was 7 in both: memoryless beyond one step
    assert torch.allclose(b.logits[0, 2], base[0, 2] + w[:, 77], atol=1e-5)
    assert torch.allclose(a.logits[0, 0], base[0, 0] + w[:, int(ids[0, -1])], atol=1e-5)
    assert not torch.allclose(a.confidence[:, 2], b.confidence[:, 2])


@pytest.mark.parametrize("anchor_feature", [True, False])
def test_block_rows_see_only_the_context_before_their_anchor(target, anchor_feature):
    """Two blocks of one row in one forward (training) = each block alone after its own context."""
    d = make_drafter(target, anchor_feature=anchor_feature)
    ids = torch.randint(1, target.cfg.vocab_size, (1, 12))
    with torch.no_grad():
        _, feats = target(ids, feature_layers=LAYERS)
        pos = torch.arange(12)[None]
        fused = d.fuse(feats)
        last = fused[:, [3, 8]] if anchor_feature else None  # the fused features of positions a - 1
        both = d.block_hidden(ids[:, [4, 9]], torch.tensor([[4, 9]]), d.context_kv(fused, pos), pos, last)
        for n, a in enumerate((4, 9)):
            ctx = d.fuse(feats[:, :a])
            alone = d.block_hidden(ids[:, [a]], torch.tensor([[a]]), d.context_kv(ctx, pos[:, :a]), pos[:, :a],
                                   ctx[:, -1:] if anchor_feature else None)
            assert torch.allclose(both[:, n], alone[:, 0], atol=1e-5)


def test_block_rows_read_the_feature_before_the_anchor(target):
    """With `anchor_feature` each row's input is fc_in([fused feature of a - 1 ; its embedding]):
    another feature there moves every row of the block; without it the call is refused."""
    d = make_drafter(target)
    ids = torch.randint(1, target.cfg.vocab_size, (1, 9))
    with torch.no_grad():
        _, feats = target(ids[:, :8], feature_layers=LAYERS)
        fused = d.fuse(feats)
        pos = torch.arange(8)[None]
        kv = d.context_kv(fused, pos)
        h = d.block_hidden(ids[:, 8:], torch.tensor([[8]]), kv, pos, fused[:, -1:])
        other = d.block_hidden(ids[:, 8:], torch.tensor([[8]]), kv, pos, fused[:, -2:-1])
        assert all(not torch.allclose(h[0, 0, k], other[0, 0, k]) for k in range(d.cfg.block_size))
        assert torch.equal(d.propose(feats, ids[:, 8]).logits, d.draw(h[:, 0], ids[:, 8]).logits)
        with pytest.raises(ValueError, match="fused feature before the anchor"):
            d.block_hidden(ids[:, 8:], torch.tensor([[8]]), kv, pos)


def test_saved_directory_round_trips(target, tmp_path):
    d = make_drafter(target, block_size=3, rank=6)
    save_dspark(d, tmp_path / "dspark")
    cfg = json.loads((tmp_path / "dspark" / "config.json").read_text())
    assert cfg["architectures"] == ["DSparkDrafter"] and cfg["target_feature_layers"] == list(LAYERS)
    assert cfg["block_size"] == 3 and cfg["markov_rank"] == 6
    back = load_dspark(tmp_path / "dspark", target)
    assert not any(p.requires_grad for p in back.parameters())
    assert set(back.state_dict()) == set(d.state_dict())  # the target's embeddings and head are not saved
    ids = torch.randint(1, target.cfg.vocab_size, (2, 7))
    with torch.no_grad():
        _, feats = target(ids, feature_layers=LAYERS)
        x, y = d.propose(feats, ids[:, -1]), back.propose(feats, ids[:, -1])
    assert torch.equal(x.tokens, y.tokens) and torch.allclose(x.logits, y.logits)
    old = make_drafter(target, block_size=3, rank=6, anchor_feature=False)  # a directory from before fc_in
    save_dspark(old, tmp_path / "old")
    legacy = json.loads((tmp_path / "old" / "config.json").read_text())
    del legacy["anchor_feature"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(legacy))
    back = load_dspark(tmp_path / "old", target)
    assert back.fc_in is None and not back.cfg.anchor_feature
    assert torch.equal(back.propose(feats, ids[:, -1]).tokens, old.propose(feats, ids[:, -1]).tokens)
    bad = DSparkConfig.for_target(target.cfg, feature_layers=[0, 5])
    with pytest.raises(ValueError, match="target_feature_layers"):
        bad.check(target.cfg)


def _reference_features(target, ids):
    """The residual stream after each layer of a plain module-by-module forward."""
    x = target.model.embed_tokens(ids)
    cos, sin = target.rope(torch.arange(ids.shape[1])[None])
    out = []
    for layer in target.model.layers:
        x = layer(x, cos, sin)
        out.append(x)
    return torch.cat([out[i] for i in LAYERS], -1)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_runner_features_equal_a_plain_forward(target_dir, target, packed, monkeypatch):
    """Prefill (fused path where the kernels are built), a ragged batch (packed rows) and a decode
    step: features of every fed row = the plain forward's hidden states; logits unchanged."""
    import draftwise.model.packed_weights as packed_weights

    if packed:
        if not torch.backends.mkldnn.is_available():
            pytest.skip("no oneDNN in this torch build")
        monkeypatch.setattr(packed_weights, "PACK_MIN_NUMEL", 0)
    loaded = load_model(target_dir, load_tokenizer=False)
    ids = torch.randint(1, target.cfg.vocab_size, (2, 20))
    with torch.no_grad():
        ref = _reference_features(target, ids)  # [2, 20, 2H]
        h, feats = target(ids, feature_layers=LAYERS)
    assert torch.allclose(feats, ref, atol=1e-5) and torch.allclose(h, target(ids), atol=0)
    runner = ModelRunner(loaded, num_blocks=8, block_size=8)
    for s in (0, 1):
        runner.kv.reserve(s, 20)
    plain = runner.run([0], [ids[0, :12].tolist()], [0], [12])
    runner.kv.truncate(0, 0)
    runner.kv.reserve(0, 20)
    logits, f = runner.run([0], [ids[0, :12].tolist()], [0], [12], feature_layers=LAYERS)
    assert torch.equal(logits, plain) and f.shape == (12, ref.shape[-1])
    assert (f - ref[0, :12]).abs().max() <= 1e-4
    logits, f = runner.run([1, 0], [ids[1, :16].tolist(), ids[0, 12:14].tolist()], [0, 12], [1, 2],
                           feature_layers=LAYERS)
    assert f.shape == (18, ref.shape[-1])
    assert (f[:16] - ref[1, :16]).abs().max() <= 1e-4 and (f[16:] - ref[0, 12:14]).abs().max() <= 1e-4
    _, f = runner.run([0], [[int(ids[0, 14])]], [14], [1], feature_layers=LAYERS)
    assert (f[0] - ref[0, 14]).abs().max() <= 1e-4


def test_prepared_drafter_gives_the_same_blocks(target):
    """`prepare` (the projections packed for the CPU kernels, q/k/v and gate/up fused) changes
    neither the state dict nor, beyond float rounding, the blocks."""
    d = make_drafter(target)
    ids = torch.randint(1, target.cfg.vocab_size, (3, 11))
    with torch.no_grad():
        _, feats = target(ids, feature_layers=LAYERS)
        want = d.propose(feats, ids[:, -1])
        keys = set(d.state_dict())
        got = d.prepare().propose(feats, ids[:, -1])
    assert set(d.state_dict()) == keys
    assert torch.allclose(got.logits, want.logits, atol=1e-4) and torch.equal(got.tokens, want.tokens)
    assert torch.allclose(got.confidence, want.confidence, atol=1e-5)
