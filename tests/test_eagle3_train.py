"""The EAGLE-3 drafter and its training (model/eagle3.py, train/eagle3.py, eagle3_eval.py): the
directory round trip, the training-time test's loss by hand and its attention (a step's row sees
no later position), a few steps lowering the loss on a tiny target, resume, the held-out
acceptance, and the CLI's errors."""
import json
import math

import pytest
import torch

from draftwise.model import load_model
from draftwise.model.config import ModelLoadError
from draftwise.model.eagle3 import load_eagle3, save_eagle3
from draftwise.model.eagle3_config import Eagle3Config
from draftwise.train.data import Batches, encode_stream
from draftwise.train.eagle3 import build_drafter, eagle3_loss_fn, ttt_loss, val_loss
from draftwise.train.eagle3_eval import eagle3_acceptance
from draftwise.train.trainer import Trainer, TrainConfig
from tiny_models import CORPUS


@pytest.fixture(scope="module")
def tiny(target_dir, tokenizer):
    loaded = load_model(target_dir, fuse=False)
    target = loaded.model.eval().requires_grad_(False)
    return loaded, target, encode_stream(tokenizer, CORPUS)


def test_ttt_loss_by_hand():
    """T = 3 positions, 2 steps, V = 2. Step 1 compares rows 0, 1 with p[1], p[2]; step 2 row 0 with
    p[2] (row 1 would need p[3]: not counted). q uniform: each soft CE is log 2 whatever p is;
    then a certain q = p at step 2 (CE 0): loss = (log 2 + 0.8 * 0) / 1.8."""
    p = torch.tensor([[[0.5, 0.5], [1.0, 0.0], [0.0, 1.0]]])
    uniform = [torch.zeros(1, 2, 2), torch.zeros(1, 2, 2)]
    loss, per_step = ttt_loss(uniform, p)
    assert torch.allclose(per_step, torch.tensor([math.log(2)] * 2))
    assert math.isclose(float(loss), math.log(2), rel_tol=1e-6)
    certain = torch.tensor([[[-30.0, 30.0], [30.0, -30.0]]])  # row 0: q = (0, 1) = p[2]; row 1 not counted
    loss, per_step = ttt_loss([uniform[0], certain], p)
    assert float(per_step[1]) < 1e-6
    assert math.isclose(float(loss), math.log(2) / 1.8, rel_tol=1e-5)


def test_a_steps_row_sees_no_later_position(tiny):
    """Changing the window from position m on changes no row t < m - j - 1 of step j (its input
    tokens reach x_{t+j+1}): training-time test attends only what inference would have."""
    loaded, target, _ = tiny
    d = build_drafter(loaded.config, target, 3, [0, 1], 0).eval()
    ids = torch.randint(1, loaded.config.vocab_size, (1, 16))
    other = ids.clone()
    other[0, 10:] = (other[0, 10:] + 1) % loaded.config.vocab_size
    with torch.no_grad():
        outs = []
        for w in (ids, other):
            _, f = target(w, feature_layers=(0, 1))
            outs.append(d.unroll(f, w, 3))
    for j in range(3):
        keep = 10 - (j + 1)  # rows t with t + j + 1 < 10
        assert torch.allclose(outs[0][j][0, :keep], outs[1][j][0, :keep], atol=1e-5)
        assert not torch.allclose(outs[0][j][0, keep:], outs[1][j][0, keep:], atol=1e-3)


def test_a_few_steps_lower_the_loss_resume_and_acceptance(tiny, tmp_path):
    loaded, target, stream = tiny
    drafter = build_drafter(loaded.config, target, 3, [0, 1], 0)
    val = Batches(stream, 4, 32, seed=7).get(0)
    before = val_loss(drafter, target, val, 3)
    cfg = TrainConfig(ckpt_dir=str(tmp_path / "ck"), batch_size=4, seq_len=32, lr=1e-2, warmup_steps=2,
                      max_tokens=4 * 32 * 60, autocast=False)
    trainer = Trainer(drafter, Batches(stream, 4, 32), cfg, loss_fn=eagle3_loss_fn(target, 3), log=lambda m: None)
    trainer.run(stop_after=30)
    trainer.save()
    after = val_loss(drafter, target, val, 3)
    with torch.no_grad():  # the soft CE's floor: the target's own entropy (the steps' rows, weighted alike)
        p = torch.softmax(target.logits(val), -1)
        ent = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [B, T]
        floor = sum(0.8 ** (j - 1) * float(ent[:, j:].mean()) for j in (1, 2, 3)) / (1 + 0.8 + 0.64)
    assert after - floor < 0.8 * (before - floor), (before, after, floor)
    assert not any(p.grad is not None for p in target.parameters())  # the target stays frozen
    again = build_drafter(loaded.config, target, 3, [0, 1], 1)
    t2 = Trainer(again, Batches(stream, 4, 32), cfg, loss_fn=eagle3_loss_fn(target, 3), log=lambda m: None)
    assert t2.resume() and t2.step == 30
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), drafter.state_dict().values()))
    acc = eagle3_acceptance(drafter, target, val, anchors=8, steps=3)
    assert len(acc["per_position"]) == 3 and all(0 <= c <= 1 for c in acc["per_position"])
    assert 0 <= acc["expected_accepted"] <= 3
    # the directory round trip: the same drafter, the same steps
    save_eagle3(drafter, tmp_path / "e3")
    cfg_json = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert cfg_json["architectures"] == ["Eagle3Drafter"] and cfg_json["steps"] == 3
    back = load_eagle3(tmp_path / "e3", target)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), drafter.state_dict().values()))


def test_config_errors(tmp_path, tiny):
    loaded, target, _ = tiny
    cfg = Eagle3Config.for_target(loaded.config, feature_layers=[0, 1]).to_dict()
    with pytest.raises(ModelLoadError, match=r"'architectures': expected \['Eagle3Drafter'\], got \['DSpark"):
        Eagle3Config.from_dict({**cfg, "architectures": ["DSparkDrafter"]})
    with pytest.raises(ModelLoadError, match="'target_feature_layers': strictly increasing"):
        Eagle3Config.from_dict({**cfg, "target_feature_layers": "0,1"})
    with pytest.raises(ModelLoadError, match="'head_dim': an integer >= 1, got 'x'"):
        Eagle3Config.from_dict({**cfg, "head_dim": "x"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: unreadable"):
        load_eagle3(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_text("garbage")
    with pytest.raises(ModelLoadError, match="model.safetensors: unreadable"):
        load_eagle3(tmp_path, target)


def test_cli_train_eagle3_errors(tmp_path, target_dir, capsys):
    from draftwise.cli.main import main

    assert main(["train", "eagle3", "--out", str(tmp_path / "x"), "--minutes", "1"]) == 2
    assert "train eagle3 needs --target" in capsys.readouterr().err
    assert main(["train", "eagle3", "--target", str(target_dir), "--out", str(tmp_path / "x")]) == 2
    assert "train eagle3 needs --minutes or --tokens" in capsys.readouterr().err
    assert main(["train", "eagle3", "--target", str(target_dir), "--out", str(tmp_path / "x"), "--tokens", "9",
                 "--feature-layers", "0,7"]) == 2
    assert "--feature-layers 0,7: strictly increasing layer ids of the target (0 .. 1)" in capsys.readouterr().err
    assert main(["train", "eagle3", "--target", str(target_dir), "--out", str(tmp_path / "x"), "--tokens", "9",
                 "--eval-draft", str(tmp_path / "nowhere")]) == 2
    assert "--eval-draft " + str(tmp_path / "nowhere") + ": not a model directory" in capsys.readouterr().err
    assert main(["train", "eagle3", "--target", str(target_dir), "--out", str(tmp_path / "x"), "--tokens", "9",
                 "--data", "self", "--gen-model", str(tmp_path / "nowhere")]) == 2
    assert "--gen-model " + str(tmp_path / "nowhere") + ": not a model directory" in capsys.readouterr().err
    assert main(["train", "target", "--out", str(tmp_path / "x"), "--tokens", "9", "--data", "self"]) == 2
    assert "--data self is for `train draft`, `train eagle3` and `train dspark`" in capsys.readouterr().err
    assert main(["train", "draft", "--target", str(target_dir), "--out", str(tmp_path / "x"), "--tokens", "9",
                 "--draft-vocab", "100"]) == 2
    assert "--draft-vocab and --target-dtype are for `train eagle3` and `train dspark`" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "eagle3", "--target", str(target_dir), "--out", str(tmp_path / "x"), "--tokens", "9",
              "--steps", "0"])
    assert "--steps: must be an integer >= 1, got 0" in capsys.readouterr().err
