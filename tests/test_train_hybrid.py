"""`draftwise train target --arch hybrid`: the hybrid preset's size, and a few training steps of a
small hybrid config lower the loss, export to a directory that draftwise loads with the same
logits (bfloat16 weights)."""
from pathlib import Path

import pytest
import torch

from draftwise.model import load_model
from draftwise.model.hybrid import HybridModel
from draftwise.train.export import export_model
from draftwise.train.shapes import HYBRID, PRESETS, build_model, count_params, hybrid_config, llama_config


def test_hybrid_preset_is_near_the_target_size():
    n = count_params(build_model(hybrid_config(HYBRID, 8192, 0)))
    t = count_params(build_model(llama_config(PRESETS["target"], 8192, 0)))
    assert 0.9 * t <= n <= 1.2 * t


def test_small_hybrid_trains_and_exports(tmp_path, target_dir):
    shape = dict(PRESETS["tiny"], num_hidden_layers=2, linear_num_key_heads=1, linear_num_value_heads=2,
                 linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])
    model = build_model(hybrid_config(shape, 320, 0), seed=0)
    assert isinstance(model, HybridModel)
    torch.manual_seed(0)
    data = torch.randint(1, 50, (4, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        logits = model.logits(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    export_model(model, tmp_path, target_dir)
    loaded = load_model(tmp_path, dtype="float32")
    with torch.no_grad():
        want = model.to(torch.bfloat16).float().logits(data[:1])
    assert (loaded.model.logits(data[:1]) - want).abs().max() < 1e-3


SHIPPED = Path(__file__).resolve().parents[1] / "models" / "hybrid"


@pytest.mark.skipif(not (SHIPPED / "model.safetensors").is_file(), reason="models/hybrid not present")
def test_shipped_hybrid_matches_transformers_and_shares_the_tokenizer():
    transformers = pytest.importorskip("transformers")
    assert (SHIPPED / "tokenizer.json").read_bytes() == (SHIPPED.parent / "target" / "tokenizer.json").read_bytes()
    ours = load_model(SHIPPED, dtype="float32")
    assert ours.config.arch == "qwen3_next" and ours.config.hybrid.attention_layers == [3, 7]
    ids = torch.tensor([ours.tokenizer.encode("def add(a, b):\n    return a + b\n").ids])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(SHIPPED), dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = ours.model.logits(ids), hf(ids).logits.float()
    assert (a - b).abs().max() < 1e-3
