"""Sequential Temperature Scaling (train/dspark_calibration.py): the ECE by hand, temperatures that
lower the ECE of the cumulative survival on a synthetic miscalibrated set, fitted left to right,
and the drafter's confidences read through them (model/dspark.py, config.json round trip)."""
import json
import math

import pytest
import torch

from draftwise.model import load_model
from draftwise.model.config import ModelLoadError
from draftwise.model.dspark import DSparkDrafter, load_dspark, save_dspark
from draftwise.model.dspark_config import DSparkConfig
from draftwise.train.dspark_calibration import ece, fit_temperatures, report, survival


def test_ece_by_hand():
    # one bin [0.4, 0.467): mean pred 0.435, mean actual 0.25 -> 0.185
    assert math.isclose(ece(torch.tensor([0.42, 0.45]), torch.tensor([0.0, 0.5])), 0.185, abs_tol=1e-6)
    # two bins, each calibrated on average: 0
    assert ece(torch.tensor([0.1, 0.1, 0.9]), torch.tensor([0.0, 0.2, 0.9])) < 1e-12
    # weighted by the bins' shares: (2/3) * 0.5 + (1/3) * 0.0
    assert math.isclose(ece(torch.tensor([0.5, 0.5, 0.95]), torch.tensor([0.0, 0.0, 0.95])), 1 / 3, abs_tol=1e-9)
    assert ece(torch.tensor([1.0]), torch.tensor([0.0])) == 1.0  # 1.0 falls in the last bin


def _miscalibrated(n=4000, gamma=4, scale=3.0, seed=0):
    """True per-position acceptances c*_k = sigmoid(z_k); the head's logits are scale * z_k + noise
    (overconfident by `scale`)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, gamma, generator=g) * 1.2 + 0.8
    logits = scale * z + 0.05 * torch.randn(n, gamma, generator=g)
    return logits, torch.sigmoid(z)


def test_sts_lowers_the_ece_of_the_survival_on_held_out_data():
    logits, c_star = _miscalibrated()
    temps = fit_temperatures(logits, c_star)
    test_logits, test_c = _miscalibrated(seed=1)
    before, after = report(test_logits, test_c, None), report(test_logits, test_c, temps)
    assert before["ece"] > 0.05
    assert after["ece"] < 0.02 and after["ece"] < before["ece"] / 3
    assert all(a < b for a, b in zip(after["ece_per_position"], before["ece_per_position"]))
    assert all(2.0 < t < 4.5 for t in temps)  # close to the true scale 3


def test_a_calibrated_head_keeps_temperature_one():
    logits, c_star = _miscalibrated(scale=1.0)
    assert all(0.8 <= t <= 1.25 for t in fit_temperatures(logits, c_star))


def test_temperatures_are_fitted_left_to_right():
    """Position 1 calibrated, position 2 overconfident by 2: T_1 stays near 1, T_2 near 2; fitting
    position 2 alone (T_1 ignored) would not see the survival that the product gives."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(5000, 2, generator=g)
    logits = torch.stack((z[:, 0], 2 * z[:, 1]), 1)
    temps = fit_temperatures(logits, torch.sigmoid(z))
    assert 0.85 < temps[0] < 1.2 and 1.6 < temps[1] < 2.5
    s = survival(logits, temps)
    assert torch.allclose(s[:, 1], torch.sigmoid(z[:, 0] / temps[0]) * torch.sigmoid(2 * z[:, 1] / temps[1]).double())


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, fuse=False, load_tokenizer=False).model.eval()


def test_draw_reads_the_temperatures_and_they_round_trip(target, tmp_path):
    torch.manual_seed(0)
    cfg = DSparkConfig.for_target(target.cfg, block_size=3, markov_rank=8, feature_layers=[0, 1])
    d = DSparkDrafter(cfg).share(target).eval()
    ids = torch.randint(1, target.cfg.vocab_size, (2, 9))
    with torch.no_grad():
        _, feats = target(ids, feature_layers=(0, 1))
        plain = d.propose(feats, ids[:, -1])
        d.cfg.confidence_temperatures = [2.0, 0.5, 1.0]
        scaled = d.propose(feats, ids[:, -1])
    logit = torch.logit(plain.confidence.double())
    want = torch.sigmoid(logit / torch.tensor([2.0, 0.5, 1.0], dtype=torch.float64))
    assert torch.allclose(scaled.confidence.double(), want, atol=1e-5)
    assert torch.equal(scaled.tokens, plain.tokens)  # the drafted tokens do not move
    save_dspark(d, tmp_path / "d")
    assert load_dspark(tmp_path / "d", target).cfg.confidence_temperatures == [2.0, 0.5, 1.0]
    # a directory without them (saved before calibration existed) loads with T = 1
    c = json.loads((tmp_path / "d" / "config.json").read_text())
    del c["confidence_temperatures"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(c))
    assert load_dspark(tmp_path / "d", target).confidence_temperature(2) == 1.0
    c["confidence_temperatures"] = [1.0, 1.0]  # one per position or none
    (tmp_path / "d" / "config.json").write_text(json.dumps(c))
    with pytest.raises(ModelLoadError, match="confidence_temperatures"):
        load_dspark(tmp_path / "d", target)
