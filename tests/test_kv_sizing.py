"""K/V pools sized in bytes (`kv_cache_memory`, `--kv-cache-memory`): the pools fit the stated
memory, a budget below one full context is a clear error, and the default budget follows the
models' size and the machine's free memory."""
from __future__ import annotations

import pytest

from draftwise import LLM, SpecConfig
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


def test_default_budget_is_at_least_the_weights(target_dir):
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
    assert kv_sizing.default_kv_memory([Fake]) == min(2_400_000_000, (kv_sizing.available_memory() or 1 << 62) // 2)


def test_quantized_weights_count_their_bytes(target_dir, monkeypatch):
    """An int8 model's default budget follows the bytes it holds, not its parameters as float32."""
    import draftwise.model.llama as llama
    from draftwise.model import load_model

    monkeypatch.setattr(llama, "QUANT_MIN_NUMEL", 0)  # every projection int8 (the tiny model's are small)

    plain = load_model(target_dir, load_tokenizer=False)
    q8 = load_model(target_dir, load_tokenizer=False, quantization="int8")
    assert kv_sizing.weight_bytes([plain]) == plain.config.num_parameters() * 4
    assert kv_sizing.weight_bytes([q8]) < 0.6 * kv_sizing.weight_bytes([plain])
