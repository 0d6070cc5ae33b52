"""DSpark training (train/dspark.py, dspark_blocks.py, dspark_eval.py): the loss terms by hand, the
blocks' labels and weights, a few steps lowering the loss on a tiny target, resume, and the CLI."""
import math

import pytest
import torch

from draftwise.model import load_model
from draftwise.train.data import Batches, encode_stream
from draftwise.train.dspark import LossWeights, build_drafter, dspark_loss, dspark_loss_fn, val_loss
from draftwise.train.dspark_blocks import block_targets, kept_alphabet, position_weights, sample_anchors
from draftwise.train.dspark_eval import block_acceptance, draft_acceptance
from draftwise.train.trainer import Trainer, TrainConfig
from tiny_models import CORPUS


def test_loss_terms_by_hand():
    """q = (1/2, 1/4, 1/4), p = (0.7, 0.3, 0): TV = (0.2 + 0.05 + 0.25) / 2 = 0.25, c* = 0.75; label 0:
    CE = log 2; confidence logit 0 (c = 1/2): BCE = -(0.75 log 1/2 + 0.25 log 1/2) = log 2."""
    q_logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    p = torch.tensor([[0.7, 0.3, 0.0]])
    loss, t = dspark_loss(q_logits, p, torch.tensor([0]), torch.tensor([0.0]), torch.tensor([1.0]))
    assert math.isclose(float(t["tv"]), 0.25, abs_tol=1e-6) and math.isclose(float(t["c_star"][0]), 0.75, abs_tol=1e-6)
    assert math.isclose(float(t["ce"]), math.log(2), abs_tol=1e-6)
    assert math.isclose(float(t["bce"]), math.log(2), abs_tol=1e-6)
    assert math.isclose(float(loss), 0.1 * math.log(2) + 0.9 * 0.25 + 1.0 * math.log(2), abs_tol=1e-6)
    # weights: a position of weight 0 does not count; the rest are normalised by their sum
    q2 = torch.stack([q_logits[0], torch.zeros(3)])
    p2 = torch.stack([p[0], torch.tensor([0.0, 0.0, 1.0])])
    l2, _ = dspark_loss(q2, p2, torch.tensor([0, 1]), torch.zeros(2), torch.tensor([2.0, 0.0]))
    assert math.isclose(float(l2), float(loss), abs_tol=1e-6)
    # q = p: TV 0, c* 1
    _, t3 = dspark_loss(torch.log(p + 1e-12), p, torch.tensor([0]), torch.tensor([0.0]), torch.ones(1), LossWeights())
    assert float(t3["tv"]) < 1e-6 and float(t3["c_star"][0]) > 1 - 1e-6


def test_kept_alphabet_tv_is_the_whole_vocabularys():
    """A drafter over the kept tokens (train --draft-vocab): q and p over kept + "the rest" give the
    TV of the full-vocabulary q (zero outside the kept) against the full p, and a label outside
    the kept tokens has no CE term (its CE would be infinite); gradients stay finite."""
    torch.manual_seed(0)
    V, kept = 12, torch.tensor([1, 4, 5, 9])
    p_full = torch.softmax(torch.randn(3, V), -1)
    logits = torch.randn(3, len(kept), requires_grad=True)
    q_full = torch.zeros(3, V)
    q_full[:, kept] = torch.softmax(logits.detach(), -1)
    tv_full = 0.5 * (q_full - p_full).abs().sum(-1)
    p, index = kept_alphabet(p_full, kept)
    assert torch.allclose(p.sum(-1), torch.ones(3)) and index[4] == 1 and index[0] == -1
    labels = index[torch.tensor([4, 0, 9])]
    q_logits = torch.cat((logits, torch.full((3, 1), float("-inf"))), -1)
    loss, t = dspark_loss(q_logits, p, labels, torch.zeros(3), torch.ones(3))
    assert torch.allclose(t["c_star"], 1 - tv_full, atol=1e-6)
    q = torch.softmax(logits.detach(), -1)
    ce = (-torch.log(q[0, 1]) - torch.log(q[2, 3])) / 3
    assert math.isclose(float(t["ce"].detach()), float(ce), abs_tol=1e-6)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_block_labels_rows_and_weights():
    ids = torch.arange(10, 20)[None]  # [1, 10]
    labels, prev, rows, valid = block_targets(ids, torch.tensor([[2, 7]]), 3)
    assert labels.tolist() == [[[13, 14, 15], [18, 19, 19]]]
    assert prev.tolist() == [[[12, 13, 14], [17, 18, 18]]]  # the anchor, then the true tokens
    assert rows.tolist() == [[[2, 3, 4], [7, 8, 8]]]  # p_k is the target's distribution after row a+k-1
    assert valid.tolist() == [[[True] * 3, [True, True, False]]]
    w = position_weights(valid, decay=2.0)
    assert torch.allclose(w[0, 1], torch.tensor([1.0, math.exp(-0.5), 0.0]))
    a = sample_anchors(3, 40, 10, torch.Generator().manual_seed(0))
    assert a.shape == (3, 10) and (a >= 1).all() and (a <= 38).all()
    assert all(len(set(r.tolist())) == 10 and r.tolist() == sorted(r.tolist()) for r in a)


@pytest.fixture(scope="module")
def tiny(target_dir, tokenizer):
    loaded = load_model(target_dir, fuse=False)
    target = loaded.model.eval().requires_grad_(False)
    stream = encode_stream(tokenizer, CORPUS)
    return loaded, target, stream


def test_a_few_steps_lower_the_loss_and_resume(tiny, tmp_path):
    loaded, target, stream = tiny
    drafter = build_drafter(loaded.config, target, block_size=3, markov_rank=8, feature_layers=[0, 1], seed=0)
    val = Batches(stream, 4, 32, seed=7).get(0)
    before = val_loss(drafter, target, val, anchors=8, decay=3.0)
    cfg = TrainConfig(ckpt_dir=str(tmp_path / "ck"), batch_size=4, seq_len=32, lr=1e-2, warmup_steps=2,
                      max_tokens=4 * 32 * 60, autocast=False)
    trainer = Trainer(drafter, Batches(stream, 4, 32), cfg, loss_fn=dspark_loss_fn(target, 8, 3.0), log=lambda m: None)
    trainer.run(stop_after=30)
    trainer.save()
    after = val_loss(drafter, target, val, anchors=8, decay=3.0)
    assert after < 0.8 * before, (before, after)
    assert not any(p.grad is not None for p in target.parameters())  # the target stays frozen
    # resume: a fresh drafter continues from the checkpoint with the same weights and step
    again = build_drafter(loaded.config, target, block_size=3, markov_rank=8, feature_layers=[0, 1], seed=1)
    t2 = Trainer(again, Batches(stream, 4, 32), cfg, loss_fn=dspark_loss_fn(target, 8, 3.0), log=lambda m: None)
    assert t2.resume() and t2.step == 30
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), drafter.state_dict().values()))
    acc = block_acceptance(drafter, target, val, anchors=8)
    assert len(acc["per_position"]) == 3 and all(0 <= c <= 1 for c in acc["per_position"])
    assert 0 <= acc["expected_accepted"] <= 3
    # the target as its own draft: every position accepted with certainty
    same = draft_acceptance(target, target, val, anchors=8, gamma=3)
    assert all(c > 0.999 for c in same["per_position"]) and same["greedy_per_position"] == [1.0] * 3


def test_cli_train_dspark_needs_a_target_and_a_budget(tmp_path, target_dir, capsys):
    from draftwise.cli.main import main

    assert main(["train", "dspark", "--out", str(tmp_path / "x"), "--minutes", "1"]) == 2
    assert "needs --target" in capsys.readouterr().err
    assert main(["train", "dspark", "--target", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"),
                 "--minutes", "1"]) == 2
    assert "nowhere: not a model directory" in capsys.readouterr().err
    assert main(["train", "dspark", "--target", str(target_dir), "--out", str(tmp_path / "x")]) == 2
    assert "--minutes or --tokens" in capsys.readouterr().err
    assert main(["train", "dspark", "--target", str(target_dir), "--out", str(tmp_path / "x"), "--tokens", "9",
                 "--feature-layers", "0,7", "--ckpt-dir", str(tmp_path / "ck")]) == 2
    assert "--feature-layers 0,7: strictly increasing layer ids of the target (0 .. 1)" in capsys.readouterr().err
    assert main(["train", "dspark", "--target", str(target_dir), "--out", str(tmp_path / "x"), "--tokens", "9",
                 "--feature-layers", "1,0", "--ckpt-dir", str(tmp_path / "ck")]) == 2
    assert "--feature-layers 1,0: strictly increasing" in capsys.readouterr().err
    for bad in ("-1", "nan"):  # train all's budgets (before anything is trained)
        assert main(["train", "all", "--out", str(tmp_path / "m"), "--dspark-minutes", bad]) == 2
        assert "--dspark-minutes must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("layers", [[0], [0, 1]])
def test_first_layer_starts_as_the_target_layer_after_the_top_feature_layer(tiny, layers):
    """Feature layers [0] (or [0, 1]: the last layer read too) of a 2-layer target: the drafter's
    context K/V start as (nearly) the target layer 1's own keys and values of the same positions;
    with only the last layer read there is no layer after it and the initialisation stays random."""
    from draftwise.model.llama import apply_rope
    from draftwise.train.dspark import init_from_target_layer

    loaded, target, _ = tiny
    drafter = build_drafter(loaded.config, target, block_size=3, markov_rank=8, feature_layers=layers, seed=0)
    ids = torch.randint(1, loaded.config.vocab_size, (2, 12))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        _, feats = target(ids, feature_layers=tuple(layers))
        k, v = drafter.context_kv(drafter.fuse(feats), pos)[0]
        layer = target.model.layers[1]
        x = layer.input_layernorm(feats[..., : loaded.config.hidden_size])
        B, S, Hkv, D = k.shape
        cos, sin = drafter.rope(pos)
        k_ref = apply_rope(layer.self_attn.k_proj(x).view(B, S, Hkv, D), cos, sin)
        v_ref = layer.self_attn.v_proj(x).view(B, S, Hkv, D)
    assert torch.allclose(k, k_ref, atol=0.05 * float(k_ref.abs().max()))
    assert torch.allclose(v, v_ref, atol=0.05 * float(v_ref.abs().max())), float((v - v_ref).abs().max())
    top = build_drafter(loaded.config, target, block_size=3, markov_rank=8, feature_layers=[1], seed=0,
                        from_target_layer=False)
    assert not init_from_target_layer(top, target)


def test_block_forward_reads_p_at_each_blocks_rows_with_every_position_an_anchor(tiny):
    """Anchors at every position (blocks overlapping): p_k of the block at anchor a is the target's
    distribution after row a+k-1, the same as one plain target pass gives."""
    from draftwise.train.dspark_blocks import block_forward

    loaded, target, stream = tiny
    drafter = build_drafter(loaded.config, target, block_size=3, markov_rank=8, feature_layers=[0, 1], seed=0)
    ids = Batches(stream, 2, 24, seed=3).get(0)  # [2, 25]
    a = sample_anchors(2, ids.shape[1], 1000)  # clamped to T - 2 = 23: all of 1..23
    assert a.tolist() == [list(range(1, 24))] * 2
    with torch.no_grad():
        q_logits, p, conf, labels, valid = block_forward(drafter, target, ids, a)
        ref = torch.softmax(target.logits(ids).float(), -1)  # [2, 25, V]
    assert p.shape == q_logits.shape == (2, 23, 3, loaded.config.vocab_size)
    for b, n, k in [(0, 0, 0), (1, 5, 2), (0, 21, 1), (1, 20, 2)]:  # anchor n + 1, 0-based k: row n + 1 + k
        assert valid[b, n, k] and torch.allclose(p[b, n, k], ref[b, n + 1 + k], atol=1e-5)
    assert not valid[0, 22, 1]  # past the window: clamped, not counted


def test_cli_train_dspark_passes_anchors_and_backbone_init(tmp_path, target_dir, monkeypatch):
    from draftwise.cli.main import main
    from draftwise.train import dspark

    got = {}
    monkeypatch.setattr(dspark, "train_dspark", lambda *a, **kw: got.update(kw) or {})
    assert main(["train", "dspark", "--target", str(target_dir), "--out", str(tmp_path / "x"), "--tokens", "9",
                 "--anchors", "192", "--backbone-init", "random"]) == 0
    assert got["overrides"]["anchors"] == 192 and got["from_target_layer"] is False
    assert main(["train", "dspark", "--target", str(target_dir), "--out", str(tmp_path / "x"), "--tokens", "9"]) == 0
    assert got["overrides"]["anchors"] == dspark.DSPARK_DEFAULTS["anchors"] and got["from_target_layer"] is True
    with pytest.raises(SystemExit):
        main(["train", "dspark", "--target", str(target_dir), "--out", str(tmp_path / "x"), "--tokens", "9",
              "--backbone-init", "copy"])


def test_causal_blocks_first_rows_alone_and_their_loss(tiny, tmp_path):
    """A causal block's first rows alone equal the same rows of the whole block (a row reads the
    block's rows up to its own); a bidirectional block refuses. `first_anchors` adds first-row blocks
    to the loss, and a few steps with them lower it."""
    from draftwise.train.dspark_blocks import block_forward

    loaded, target, stream = tiny
    drafter = build_drafter(loaded.config, target, block_size=3, markov_rank=8, feature_layers=[0, 1], seed=0,
                            causal_block=True)
    ids = Batches(stream, 2, 32, seed=3).get(0)
    a = sample_anchors(2, ids.shape[1], 6, torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole, first = block_forward(drafter, target, ids, a, a)
    assert first[0].shape[2] == 1 and whole[0].shape[2] == 3
    for w, f in zip(whole, first):
        assert torch.allclose(w[:, :, :1].float(), f.float(), atol=1e-5)
    bidirectional = build_drafter(loaded.config, target, block_size=3, markov_rank=8, feature_layers=[0, 1], seed=0)
    with pytest.raises(ValueError, match="causal block"):
        block_forward(bidirectional, target, ids, a, a)
    with torch.no_grad():  # a bidirectional block's first row reads the mask rows after it
        assert not torch.allclose(block_forward(bidirectional, target, ids, a)[0][:, :, 0], whole[0][:, :, 0])
    val = Batches(stream, 4, 32, seed=7).get(0)
    before = val_loss(drafter, target, val, anchors=8, decay=3.0)
    cfg = TrainConfig(ckpt_dir=str(tmp_path / "ck"), batch_size=4, seq_len=32, lr=1e-2, warmup_steps=2,
                      max_tokens=4 * 32 * 60, autocast=False)
    loss_fn = dspark_loss_fn(target, 8, 3.0, first_anchors=16)
    Trainer(drafter, Batches(stream, 4, 32), cfg, loss_fn=loss_fn, log=lambda m: None).run(stop_after=30)
    assert val_loss(drafter, target, val, anchors=8, decay=3.0) < 0.8 * before
