"""The real pair of `make qwen-coder` (slow; skipped where the models are absent): Qwen2.5-Coder
1.5B drafted for by the 0.5B. Greedy speculative decoding equals plain decoding on chat prompts,
the pair's tokenizers agree, the blocks stay blocks in memory, and where float32 imports of the
two files exist ($DRAFTWISE_QWEN_FLOAT: DIR/<name>-f32, see benchmarks/qwen_coder_quality.py)
draftwise's greedy tokens equal transformers'."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from draftwise.paths import models_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from qwen_coder_prompts import DRAFT, PROMPTS, TARGET, chat_ids  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not all((models_dir() / m / "config.json").is_file() for m in (TARGET, DRAFT)),
                       reason="the Qwen2.5-Coder pair is not imported (make qwen-coder)"),
]


@pytest.fixture(scope="module")
def pair():
    from draftwise import LLM, SpecConfig

    small = dict(kv_cache_memory="128MiB", max_model_len=1024)
    plain = LLM(TARGET, spec=SpecConfig(method=None), **small)
    spec = LLM(TARGET, draft=DRAFT, spec=SpecConfig(method="draft", k=4), **small)
    return plain, spec


def test_speculative_equals_plain_and_the_draft_is_accepted(pair):
    from draftwise import SamplingParams

    plain, spec = pair
    prompts = [chat_ids(TARGET, plain.tokenizer, p) for p in PROMPTS[:3]]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base, fast = plain.generate(prompts, sp), spec.generate(prompts, sp)
    assert [o.token_ids for o in fast] == [o.token_ids for o in base]
    proposed = sum(o.stats.proposed_tokens for o in fast)
    assert sum(o.stats.accepted_tokens for o in fast) > 0.5 * proposed > 0  # the same family: mostly accepted
    assert "def " in base[0].text  # code, not noise


def test_weights_stay_blocks(pair):
    from draftwise.model.packed_weights import QuantizedEmbedding
    from draftwise.model.quantize import Int4Linear, Int8Linear

    model = pair[0].engine.runner.model
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.group == 32
    assert any(isinstance(m, Int4Linear) for m in model.modules())
    floats = sum(p.numel() * p.element_size() for p in model.parameters() if p.dtype == torch.float32)
    assert floats < 50e6  # norms and biases only: no float copy of a weight matrix


@pytest.mark.skipif(not os.environ.get("DRAFTWISE_QWEN_FLOAT"), reason="no float32 imports ($DRAFTWISE_QWEN_FLOAT)")
@pytest.mark.parametrize("name", [DRAFT, TARGET])
def test_float_import_greedy_equals_transformers(name):
    from qwen_coder_quality import compare, draftwise_greedy, transformers_greedy
    from tokenizers import Tokenizer

    fdir = Path(os.environ["DRAFTWISE_QWEN_FLOAT"]) / f"{name}-f32"
    tok = Tokenizer.from_file(str(fdir / "tokenizer.json"))
    prompts = [chat_ids(str(fdir), tok, p) for p in PROMPTS[:2]]
    ours, _ = draftwise_greedy(fdir, prompts, 32)
    assert compare(ours, transformers_greedy(fdir, prompts, 32))["equal"] == len(prompts)
