"""The draft's dtype: bfloat16 on a CPU with native bfloat16 products by default (also under a
float32 target), float32 on other CPUs, or as asked;
greedy speculative output stays the target's own whatever the draft's precision."""
import pytest
import torch

from draftwise import LLM, SamplingParams
from draftwise.engine import SpecConfig
from draftwise.engine.config import draft_dtype_for


def _dtype(llm, which):
    runner = llm.engine.runner if which == "target" else llm.engine.proposer.runner
    return next(runner.model.parameters()).dtype


@pytest.mark.parametrize("native", [True, False])
def test_draft_dtype_rule(monkeypatch, native):
    from draftwise.model import cpu_kernels
    monkeypatch.setattr(cpu_kernels, "bf16_native", lambda: native)
    assert draft_dtype_for("float32", "cpu") == ("bfloat16" if native else "float32")
    assert draft_dtype_for("bfloat16", "cpu") == ("bfloat16" if native else "float32")
    assert draft_dtype_for("float32", "cuda") == "float32"
    assert draft_dtype_for("float32", "cpu", "float32") == "float32"


def test_mixed_dtypes(target_dir, draft_dir):
    spec = SpecConfig(method="draft", k=4)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [40, 41]]
    # a float32 target gets a bfloat16 draft by default on a CPU with native bfloat16, or the dtype asked for
    from draftwise.model.cpu_kernels import bf16_native
    llm = LLM(target_dir, draft=draft_dir, spec=spec, dtype="float32")
    want_draft = torch.bfloat16 if bf16_native() else torch.float32
    assert _dtype(llm, "target") == torch.float32 and _dtype(llm, "draft") == want_draft
    asked = LLM(target_dir, draft=draft_dir, spec=spec, dtype="bfloat16", draft_dtype="float32")
    assert _dtype(asked, "draft") == torch.float32
    assert all(len(o.token_ids) == 24 for o in asked.generate(prompts, sp))
    outs = llm.generate(prompts, sp)
    assert all(len(o.token_ids) == 24 for o in outs) and sum(o.stats.rounds for o in outs) > 0
    # a float32 target with a bfloat16 draft: greedy output is still exactly the target's own
    # (bfloat16 targets are not compared: their 1- and 5-token forwards round differently)
    # (the draft is the target itself in bfloat16: most proposals agree, rounding makes some not)
    mixed = LLM(target_dir, draft=target_dir, spec=spec, dtype="float32", draft_dtype="bfloat16")
    assert _dtype(mixed, "draft") == torch.bfloat16
    want = [o.token_ids for o in LLM(target_dir, dtype="float32").generate(prompts, sp)]
    got = mixed.generate(prompts, sp)
    assert [o.token_ids for o in got] == want
    assert 0 < sum(o.stats.accepted_tokens for o in got)
