"""Logits of draftwise's own Llama-family runner match transformers' on random checkpoints."""
import pytest
import torch

from draftwise.model.runner import ModelRunner
from draftwise.model import load_model

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

CASES = {
    "llama3-rope-tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, tie_word_embeddings=True)),
    "llama2": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
}


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name, packed, tmp_path, monkeypatch):
    """Also with every projection packed for oneDNN (the tiny test weights are below the size at
    which draftwise packs them; the shipped models' are above)."""
    import draftwise.model.packed_weights as packed_weights

    if packed:
        if not torch.backends.mkldnn.is_available():
            pytest.skip("no oneDNN in this torch build")
        monkeypatch.setattr(packed_weights, "PACK_MIN_NUMEL", 0)
    cfg_cls, model_cls, extra = CASES[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
    ref_model = getattr(transformers, model_cls)(cfg).eval()
    ref_model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, load_tokenizer=False)
    assert loaded.model.lm_head.is_packed == packed
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        ref = ref_model(ids).logits
    ours = loaded.model.logits(ids)
    assert (ref - ours).abs().max() <= 1e-4
    # the paged-cache path (prefill a chunk, then one token at a time) agrees as well
    runner = ModelRunner(loaded, num_blocks=8, block_size=8)
    runner.kv.reserve(0, 24)
    first = runner.run([0], [ids[0, :16].tolist()], [0], [16])
    assert (first - ref[0, :16]).abs().max() <= 1e-4
    for t in range(16, 24):
        step = runner.run([0], [[int(ids[0, t])]], [t], [1])
        assert (step[0] - ref[0, t]).abs().max() <= 1e-4
    # a ragged batch (padding, masks, gathered slots): the second sequence's prefill next to the
    # first sequence's last token
    runner.kv.reserve(1, 24)
    both = runner.run([1, 0], [ids[1, :20].tolist(), [int(ids[0, 23])]], [0, 23], [20, 1])
    assert (both[:20] - ref[1, :20]).abs().max() <= 1e-4
    assert (both[20] - ref[0, 23]).abs().max() <= 1e-4


def test_bfloat16_close_to_float32(target_dir):
    f32 = load_model(target_dir, load_tokenizer=False).model
    bf16 = load_model(target_dir, dtype="bfloat16", load_tokenizer=False).model
    ids = torch.randint(0, 100, (1, 16))
    a, b = f32.logits(ids), bf16.logits(ids)
    assert b.dtype == torch.float32  # logits are always returned in float32
    assert (a - b).abs().max() <= 0.1 * a.abs().max()
