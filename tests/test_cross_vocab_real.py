"""SmolLM2-135M (another tokenizer) drafting for Qwen2.5-Coder-1.5B across vocabularies (slow;
skipped where the models are absent): greedy speculative output equals plain output on chat
prompts, and the draft's proposals are accepted at times."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from draftwise.paths import models_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from qwen_coder_prompts import PROMPTS, TARGET, chat_ids  # noqa: E402

CROSS_DRAFT = "smollm2"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not all((models_dir() / m / "config.json").is_file() for m in (TARGET, CROSS_DRAFT)),
                       reason="Qwen2.5-Coder-1.5B or SmolLM2 is not imported (make qwen-coder, make smollm2)"),
]


def test_smollm2_drafts_for_qwen_and_greedy_equals_plain():
    from draftwise import LLM, SamplingParams, SpecConfig
    from draftwise.proposers.cross_vocab import CrossVocabProposer

    small = dict(kv_cache_memory="128MiB", max_model_len=1024)
    plain = LLM(TARGET, spec=SpecConfig(method=None), **small)
    cross = LLM(TARGET, draft=CROSS_DRAFT, spec=SpecConfig(method="draft", k=4), **small)
    proposer = cross.engine.proposer
    assert isinstance(proposer, CrossVocabProposer)
    assert proposer.vmap.size > cross.engine.proposer.runner.cfg.vocab_size // 2  # most of SmolLM2's tokens
    prompts = [chat_ids(TARGET, plain.tokenizer, p) for p in PROMPTS[:2]]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    base, fast = plain.generate(prompts, sp), cross.generate(prompts, sp)
    assert [o.token_ids for o in fast] == [o.token_ids for o in base]
    assert sum(o.stats.accepted_tokens for o in fast) > 0
