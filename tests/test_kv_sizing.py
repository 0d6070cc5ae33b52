"""K/V pools sized in bytes (`kv_cache_memory`, `--kv-cache-memory`): the pools fit the stated
memory, a budget below one full context is a clear error, the default budget follows the
models' size and the machine's free memory, a context the pools cannot hold is fitted to them
(or kept when asked for), and the cross-vocabulary draft's larger pool counts in the budget."""
from __future__ import annotations

import pytest

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.cli.main import main
from draftwise.engine import kv_sizing
from draftwise.engine.kv_sizing import GIB, parse_memory

MIB = 1 << 20


@pytest.mark.parametrize("text,expected", [
    ("2GiB", 2 * GIB), ("512MB", 512 * 10**6), ("1.5 G", 1.5e9), ("64mib", 64 * MIB), ("4096", 4096), (123456, 123456),
])
def test_parse_memory(text, expected):
    assert parse_memory(text) == int(expected)


@pytest.mark.parametrize("bad", ["", "2x", "GiB", "-1GiB", 0, "1.2.3MB"])
def test_parse_memory_rejects(bad):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_memory(bad)


def pool_bytes(llm) -> int:
    eng = llm.engine
    total = eng.runner.cache.nbytes
    if eng.proposer is not None and getattr(eng.proposer, "runner", None) is not None:
        total += eng.proposer.runner.cache.nbytes
    return total


def test_pool_fits_the_stated_memory(target_dir):
    # target: 2 layers x 2 (K, V) x 2 heads x 16 dims x 4 bytes = 512 bytes per token
    llm = LLM(target_dir, kv_cache_memory="1MiB")
    assert MIB - 512 * 16 < pool_bytes(llm) <= MIB
    assert llm.engine.runner.kv.pool.num_blocks == MIB // (512 * 16)


def test_pools_of_target_and_draft_share_the_budget(target_dir, draft_dir):
    llm = LLM(target_dir, draft=draft_dir, spec=SpecConfig(method="draft", k=3), kv_cache_memory="1MiB")
    per_block = (512 + 1 * 2 * 1 * 16 * 2) * 16  # + the bfloat16 draft: 1 layer, 1 K/V head of 16 dims
    assert MIB - per_block < pool_bytes(llm) <= MIB
    assert llm.engine.proposer.runner.kv.pool.num_blocks == llm.engine.runner.kv.pool.num_blocks


def test_too_small_is_a_clear_error(target_dir):
    with pytest.raises(ValueError, match=r"too small: one full context \(257 tokens"):
        LLM(target_dir, kv_cache_memory="100KB", max_model_len=256)


def test_cli_too_small_is_one_line(target_dir, capsys):
    assert main(["generate", "--model", str(target_dir), "--kv-cache-memory", "10KB", "hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "too small: one full context" in err and "--kv-cache-memory" in err


def test_default_budget(target_dir, monkeypatch):
    # plenty of memory: the token rule (max_num_seqs full contexts) is the smaller bound
    monkeypatch.setattr(kv_sizing, "available_memory", lambda: 64 * GIB)
    llm = LLM(target_dir, max_num_seqs=4)
    assert llm.engine.runner.kv.pool.num_blocks == -(-4 * 257 // 16)
    assert kv_sizing.default_kv_memory([llm.engine.target]) == 512 * MIB  # small weights: the floor
    # little free memory: half of it
    monkeypatch.setattr(kv_sizing, "available_memory", lambda: 2 * MIB)
    assert LLM(target_dir).engine.runner.kv.pool.num_blocks == MIB // (512 * 16)
    # almost none: still one full context
    monkeypatch.setattr(kv_sizing, "available_memory", lambda: 1000)
    assert LLM(target_dir).engine.runner.kv.pool.num_blocks == -(-257 // 16)


def test_default_budget_is_half_the_weights():
    class Fake:
        class config:
            @staticmethod
            def num_parameters():
                return 600_000_000

        class model:
            @staticmethod
            def parameters():
                import torch
                return iter([torch.zeros(1)])

    assert kv_sizing.weight_bytes([Fake]) == 2_400_000_000
    assert kv_sizing.default_kv_memory([Fake]) == min(1_200_000_000, (kv_sizing.available_memory() or 1 << 62) // 2)


def test_quantized_weights_count_their_bytes(target_dir, monkeypatch):
    """An int8 model's default budget follows the bytes it holds, not its parameters as float32."""
    import draftwise.model.llama as llama
    from draftwise.model import load_model

    monkeypatch.setattr(llama, "QUANT_MIN_NUMEL", 0)  # every projection int8 (the tiny model's are small)

    plain = load_model(target_dir, load_tokenizer=False)
    q8 = load_model(target_dir, load_tokenizer=False, quantization="int8")
    assert kv_sizing.weight_bytes([plain]) == plain.config.num_parameters() * 4
    assert kv_sizing.weight_bytes([q8]) < 0.6 * kv_sizing.weight_bytes([plain])


BLOCK = 512 * 16  # bytes of one block of the tiny target's K/V


def test_default_fits_the_context_to_the_budget(target_dir, monkeypatch):
    """The model's context (256 tokens) does not fit a 10-block budget: the context becomes the
    159 tokens the pool holds (+ 1 of lookahead), and a longer request is refused."""
    monkeypatch.setattr(kv_sizing, "available_memory", lambda: 2 * 10 * BLOCK)
    monkeypatch.setattr(kv_sizing, "MIN_CONTEXT", 64)
    eng = LLM(target_dir).engine
    assert eng.runner.kv.pool.num_blocks == 10 and eng.max_model_len == 159
    assert eng.kv_plan.source == "default" and eng.kv_plan.model_len == 256
    with pytest.raises(ValueError, match="maximum context length is 159 tokens"):
        eng.add_request("long", [5] * 150, SamplingParams(max_tokens=20))
    assert "max model length 159 (the model's 256 does not fit" in eng.kv_plan.describe()


def test_fitted_context_has_a_floor(target_dir, monkeypatch):
    """Below MIN_CONTEXT tokens the default pool grows instead (here to 128 + 1 tokens)."""
    monkeypatch.setattr(kv_sizing, "available_memory", lambda: 2 * 4 * BLOCK)
    monkeypatch.setattr(kv_sizing, "MIN_CONTEXT", 128)
    eng = LLM(target_dir).engine
    assert eng.runner.kv.pool.num_blocks == 9 and eng.max_model_len == 9 * 16 - 1


def test_an_asked_context_is_kept(target_dir, monkeypatch):
    monkeypatch.setattr(kv_sizing, "available_memory", lambda: 2 * 10 * BLOCK)
    monkeypatch.setattr(kv_sizing, "MIN_CONTEXT", 64)
    eng = LLM(target_dir, max_model_len=250).engine  # the default pool grows to one full context
    assert eng.max_model_len == 250 and eng.runner.kv.pool.num_blocks == -(-251 // 16)
    with pytest.raises(ValueError, match=r"too small: one full context \(251 tokens"):
        LLM(target_dir, max_model_len=250, kv_cache_memory=10 * BLOCK)


def test_stated_budget_fits_the_context(target_dir, monkeypatch):
    monkeypatch.setattr(kv_sizing, "MIN_CONTEXT", 64)
    eng = LLM(target_dir, kv_cache_memory=10 * BLOCK).engine
    assert eng.runner.kv.pool.num_blocks == 10 and eng.max_model_len == 159
    assert eng.kv_plan.nbytes == 10 * BLOCK and eng.kv_plan.source == "kv_cache_memory"
    eng = LLM(target_dir, num_kv_blocks=12).engine
    assert eng.max_model_len == 12 * 16 - 1 and eng.kv_plan.source == "num_kv_blocks"


def test_cross_vocab_pool_counts_twice(tmp_path, target_dir):
    """The cross-vocabulary draft keeps twice the target's blocks: the budget holds both pools."""
    from tiny_models import CORPUS, make_model_dir
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())  # byte-level BPE over other text: another vocabulary
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=["<pad>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS[::-1], trainer)
    draft = make_model_dir(tmp_path / "d", seed=1, tokenizer=tok, layers=1, hidden=32, heads=2, kv_heads=1, inter=64)
    # the draft model's method runs across vocabularies here (drafting_class): its pool counts twice
    eng = LLM(target_dir, draft=draft, spec=SpecConfig(method="draft", k=2), kv_cache_memory="1MiB").engine
    blocks = eng.runner.kv.pool.num_blocks
    assert eng.proposer.runner.kv.pool.num_blocks == 2 * blocks
    per_token = 512 + 2 * (1 * 2 * 1 * 16 * eng.proposer.runner.cache.element_size())
    assert blocks == MIB // (per_token * 16)
    assert MIB - per_token * 16 < eng.runner.cache.nbytes + eng.proposer.runner.cache.nbytes <= MIB


def test_pool_tensor_is_zeroed_after_a_heap_trim():
    import torch

    from draftwise.kv import pool_tensor

    t = pool_tensor((2, 2, 32, 1, 4), torch.bfloat16, "cpu")
    assert t.shape == (2, 2, 32, 1, 4) and t.dtype == torch.bfloat16 and not t.any()
