"""After a round with rejections, cached logits equal a fresh recompute of the committed prefix."""
import torch

from draftwise import SamplingParams, SpecConfig
from draftwise.engine import EngineConfig, LLMEngine
from draftwise.model import load_model


def cached_next_logits(runner, seq_id: int, ids: list[int], computed: int) -> torch.Tensor:
    """Feed the not-yet-cached tail through the paged cache; logits after the last token."""
    runner.kv.reserve(seq_id, len(ids))
    return runner.run([seq_id], [ids[computed:]], [computed], [1])[0]


def test_rollback_matches_recompute(target_dir, draft_dir):
    target = load_model(target_dir)
    draft = load_model(draft_dir, load_tokenizer=False)
    engine = LLMEngine(target, draft, SpecConfig(method="draft", k=4), EngineConfig())
    seqs = [
        engine.add_request(f"r{i}", list(range(3 + i, 12 + 2 * i)), SamplingParams(temperature=t, seed=i, max_tokens=40, ignore_eos=True))
        for i, t in enumerate([0.0, 1.0, 0.0])
    ]
    for _ in range(6):
        engine.step()
    for seq in seqs:
        assert seq.stats.proposed_tokens > seq.stats.accepted_tokens, "expected rejections"
        ids = seq.all_ids
        assert seq.num_computed == len(ids) - 1
        with torch.no_grad():
            fresh_p = target.model.logits(torch.tensor([ids]))[0, -1]
            fresh_q = draft.model.logits(torch.tensor([ids]))[0, -1]
        # stale K/V of rejected proposals sits beyond the committed length: it must not leak in
        got_p = cached_next_logits(engine.runner, seq.seq_id, ids, seq.num_computed)
        runner_q = engine.proposer.runner
        got_q = cached_next_logits(runner_q, seq.seq_id, ids, seq.draft_computed)
        assert (got_p - fresh_p).abs().max() <= 1e-5
        assert (got_q - fresh_q).abs().max() <= 1e-5


def test_blocks_freed_after_generation(target_dir, draft_dir):
    target = load_model(target_dir)
    draft = load_model(draft_dir, load_tokenizer=False)
    engine = LLMEngine(target, draft, SpecConfig(method="draft", k=3), EngineConfig(num_kv_blocks=64, block_size=4, max_model_len=128))
    for i in range(5):
        engine.add_request(f"r{i}", list(range(1, 20)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.runner.kv.pool.num_free == 64
    assert engine.proposer.kv.pool.num_free == 64
