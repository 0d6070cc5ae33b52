"""Training pipeline: corpus split, shipped tokenizer and models, trainer resume, acceptance maths."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftwise.train import corpus
from draftwise.train.data import Batches
from draftwise.train.distill import kd_loss_fn
from draftwise.train.evaluate import cut_function, expected_rounds, parses
from draftwise.train.shapes import PRESETS, build_model, count_params, llama_config
from draftwise.train.trainer import Trainer, TrainConfig

MODELS = Path(__file__).resolve().parents[1] / "models"
SHIPPED = (MODELS / "target" / "model.safetensors").is_file() and (MODELS / "draft" / "model.safetensors").is_file()
needs_models = pytest.mark.skipif(not SHIPPED, reason="models/ not trained yet (make models)")


def test_split_is_deterministic_and_disjoint():
    a, b = corpus.split(), corpus.split()
    assert a.train == b.train and a.held_out == b.held_out
    assert not set(a.train) & set(a.held_out)
    n = len(a.train) + len(a.held_out)
    assert 0.03 <= len(a.held_out) / n <= 0.08
    for rel in a.train + a.held_out:
        assert "site-packages" not in rel.parts and rel.parts[0] != "test"
    assert all(corpus.is_held_out(r) for r in a.held_out)
    assert {r.parts[0] for r in a.held_out} <= set(corpus.HELD_OUT)


@needs_models
def test_shipped_tokenizer_roundtrips_every_held_out_file():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODELS / "target" / "tokenizer.json"))
    assert tok.get_vocab_size() == 8192 and tok.token_to_id("<|endoftext|>") == 0
    texts = corpus.split().texts("held_out")
    assert texts
    for path, text in texts:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text, path
    assert (MODELS / "draft" / "tokenizer.json").read_bytes() == (MODELS / "target" / "tokenizer.json").read_bytes()


@needs_models
@pytest.mark.parametrize("name", ["target", "draft"])
def test_shipped_model_loads_in_draftwise_and_transformers_with_same_logits(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftwise.model.loader import load_model

    d = MODELS / name
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["max_position_embeddings"] >= 1024
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 0
    ours = load_model(d, dtype="float32")
    hf_tok = AutoTokenizer.from_pretrained(str(d))
    assert hf_tok.eos_token == "<|endoftext|>"
    path, text = corpus.split().texts("held_out")[0]
    snippet = text[:600]
    ids = ours.tokenizer.encode(snippet).ids
    assert hf_tok(snippet)["input_ids"] == ids
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        a = ours.model.logits(x)
        b = hf(x).logits.float()
    assert torch.allclose(a, b, atol=2e-2, rtol=2e-2), (a - b).abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.99


@needs_models
def test_shipped_pair_sizes():
    from draftwise.model.config import ModelConfig

    t, d = ModelConfig.from_dir(MODELS / "target"), ModelConfig.from_dir(MODELS / "draft")
    assert 20e6 <= t.num_parameters() <= 40e6
    assert d.num_parameters() <= t.num_parameters() / 8
    # what the repository ships (models made locally, e.g. `make smollm2`, are git-ignored)
    shipped = [f for sub in ("target", "draft") for f in (MODELS / sub).rglob("*")] + list(MODELS.glob("*.*"))
    total = sum(f.stat().st_size for f in shipped if f.is_file())
    assert total <= 100e6


def _tiny_trainer(tmp_path, stream):
    model = build_model(llama_config(PRESETS["tiny"], 64, 0), seed=0)
    cfg = TrainConfig(ckpt_dir=str(tmp_path), batch_size=2, seq_len=16, warmup_steps=2, max_tokens=6 * 2 * 16,
                      log_every_s=1e9, ckpt_every_s=1e9)
    return Trainer(model, Batches(stream, 2, 16, seed=3), cfg, log=lambda m: None)


def test_trainer_resume_gives_identical_state(tmp_path):
    stream = torch.randint(0, 64, (2000,), generator=torch.Generator().manual_seed(0)).to(torch.int16)
    full = _tiny_trainer(tmp_path / "a", stream)
    full.run()
    assert full.step == 6

    first = _tiny_trainer(tmp_path / "b", stream)
    first.run(stop_after=3)
    first.save()
    del first
    resumed = _tiny_trainer(tmp_path / "b", stream)
    assert resumed.resume() and resumed.step == 3
    resumed.run()
    assert resumed.step == 6
    for (k, v), (k2, v2) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    sa, sb = full.opt.state_dict()["state"], resumed.opt.state_dict()["state"]
    for i in sa:
        for key in sa[i]:
            assert torch.equal(sa[i][key], sb[i][key])


@pytest.mark.parametrize("native", [False, True])
def test_bfloat16_autocast_only_where_the_cpu_multiplies_it(tmp_path, monkeypatch, native):
    """bfloat16 autocast without native bfloat16 products runs torch's generic matmul (~7x slower
    than float32 on an AVX2-only CPU): the trainer must train in float32 there, and say so."""
    import draftwise.train.trainer as trainer_mod
    monkeypatch.setattr(trainer_mod, "bf16_native", lambda: native)
    seen = []
    model = build_model(llama_config(PRESETS["tiny"], 64, 0), seed=0)
    cfg = TrainConfig(ckpt_dir=str(tmp_path), batch_size=2, seq_len=16, warmup_steps=2, max_tokens=2 * 2 * 16,
                      log_every_s=1e9, ckpt_every_s=1e9)
    stream = torch.randint(0, 64, (2000,), generator=torch.Generator().manual_seed(0)).to(torch.int16)
    dtypes = []
    t = Trainer(model, Batches(stream, 2, 16, seed=3), cfg, log=seen.append,
                loss_fn=lambda m, b: (dtypes.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu")
                                                    else None), trainer_mod.ce_loss(m, b))[1])
    assert t.autocast is native
    assert any("float32" in m for m in seen) is (not native)
    t.run()
    assert dtypes == [torch.bfloat16 if native else None] * 2


def test_batches_are_a_pure_function_of_the_step():
    stream = torch.arange(1000).to(torch.int16)
    a, b = Batches(stream, 4, 8, seed=1), Batches(stream, 4, 8, seed=1)
    assert torch.equal(a.get(7), b.get(7)) and torch.equal(a.get(200), b.get(200))
    assert torch.equal(a.get(0)[:, 1:], a.get(0)[:, :-1] + 1)  # contiguous windows


def test_distillation_loss_is_zero_against_itself():
    model = build_model(llama_config(PRESETS["tiny"], 64, 0), seed=0)
    batch = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        loss = float(kd_loss_fn(model, alpha=1.0)(model, batch))
    assert loss == pytest.approx(0.0, abs=1e-5)


def test_draft_preset_is_at_most_an_eighth_of_the_target():
    t = count_params(build_model(llama_config(PRESETS["target"], 8192, 0)))
    d = count_params(build_model(llama_config(PRESETS["draft"], 8192, 0)))
    assert 20e6 <= t <= 40e6 and d <= t / 8


def test_expected_rounds_matches_greedy_simulation():
    assert expected_rounds([1.0] * 10, k=4) == (2.0, 10.0, 8.0)  # 5 + 5 committed
    # first draft token rejected every time: one token per round
    r, c, a = expected_rounds([0.0] * 6, k=4)
    assert (r, c, a) == (6.0, 6.0, 0.0)
    # mixed: [1,1,0 | 1,1,1,1 -> 5 | ...]
    r, c, a = expected_rounds([1, 1, 0, 1, 1, 1, 1, 0, 0], k=4)
    assert c == 9 and r == 3  # 3 tokens, 5 tokens, 1 token


def test_cut_function_stops_at_dedent():
    prompt = 'def f(x):\n    """Doc."""\n'
    comp = "    return x + 1\n\n\ndef g():\n    pass\n"
    cut = cut_function(prompt, comp)
    assert cut.rstrip().endswith("return x + 1") and parses(cut)
    assert not parses(cut_function(prompt, "    return (x +\n"))


def test_warm_start_copies_weights_and_rejects_another_shape(tmp_path):
    from draftwise.model.loader import save_model
    from draftwise.train.distill import _warm_start

    cfg = llama_config(PRESETS["tiny"], 64, 0)
    src = build_model(cfg, seed=1)
    save_model(src, tmp_path / "src", dtype=torch.float32)
    dst = build_model(cfg, seed=2)
    _warm_start(dst, tmp_path / "src")
    for (k, v), (k2, v2) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    other = build_model(llama_config(dict(PRESETS["tiny"], hidden_size=48, head_dim=24), 64, 0))
    with pytest.raises(ValueError, match="do not match the draft shape"):
        _warm_start(other, tmp_path / "src")


def test_random_draft_has_the_targets_vocabulary_and_tokenizer(target_dir, tmp_path):
    from draftwise.cli.main import main as cli
    from draftwise.model.config import ModelConfig

    out = tmp_path / "useless"
    assert cli(["train", "random-draft", "--target", str(target_dir), "--out", str(out), "--shape", "tiny"]) == 0
    cfg, tcfg = ModelConfig.from_dir(out), ModelConfig.from_dir(target_dir)
    assert cfg.vocab_size == tcfg.vocab_size and cfg.hidden_size == PRESETS["tiny"]["hidden_size"]
    assert (out / "tokenizer.json").read_bytes() == (target_dir / "tokenizer.json").read_bytes()
    assert cli(["train", "random-draft", "--target", str(tmp_path / "nope"), "--out", str(out)]) == 2
