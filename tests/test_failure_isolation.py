"""Failure isolation by construction: one poisoned request fails alone, the others are untouched.

Two ways a request can break a step: a value that makes its own distribution unusable (NaN logits:
caught per row by `verify`), and an exception in a batched phase (the drafter's or the target's
forward, `process_logits`; isolated by requeueing and re-admitting one at a time). In both cases
the other sequences of the batch must finish with exactly the tokens they produce alone.
"""
import pytest

from draftwise import LLM, SamplingParams, SpecConfig

PROMPTS = [[20 + i, 3, 4, 5] for i in range(8)]


def greedy(n=24):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def poisoned_temperature():
    """A temperature that turns the logits into NaN (validation rejects such values; here it is
    set after validation on purpose: the engine's own guard is under test)."""
    sp = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)
    sp.temperature = float("nan")
    return sp


def run(llm, prompts, params):
    eng = llm.engine
    seqs = [eng.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    while eng.has_unfinished():
        eng.step()
    for s in seqs:
        eng.release(s.request_id)
    return seqs


@pytest.fixture(scope="module", params=[None, "draft", "ngram"])
def llm(request, target_dir, draft_dir):
    spec = SpecConfig(method=request.param, k=3) if request.param else None
    return LLM(str(target_dir), draft=str(draft_dir) if request.param == "draft" else None, spec=spec)


def test_unusable_distribution_fails_only_its_request(llm):
    alone = [s.output_ids for s in run(llm, PROMPTS[:7], [greedy()] * 7)]
    seqs = run(llm, PROMPTS[:7] + [[9, 3, 4]], [greedy()] * 7 + [poisoned_temperature()])
    assert seqs[7].finish_reason == "error" and "unusable" in seqs[7].error
    assert [s.finish_reason for s in seqs[:7]] == ["length"] * 7
    assert [s.output_ids for s in seqs[:7]] == alone
    kv = llm.engine.occupancy()["kv"]
    assert kv["target"]["used"] == 0 and (kv["draft"] is None or kv["draft"]["used"] == 0)


def test_exception_in_a_batched_phase_is_isolated(llm, monkeypatch):
    """The target's forward raises whenever the poisoned sequence is in it: the step's sequences
    are requeued and re-admitted one by one; only the culprit fails."""
    alone = [s.output_ids for s in run(llm, PROMPTS[:7], [greedy()] * 7)]
    eng = llm.engine
    real = eng.runner.run

    def run_with_poison(seq_ids, *args, **kw):
        if any(eng_seq.prompt_ids[0] == 9 for eng_seq in eng.seqs.values() if eng_seq.seq_id in seq_ids):
            raise RuntimeError("injected failure")
        return real(seq_ids, *args, **kw)

    monkeypatch.setattr(eng.runner, "run", run_with_poison)
    params = [greedy()] * 8
    eng_seqs = [eng.add_request(f"x{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS[:7] + [[9, 3, 4]], params))]
    for _ in range(3):  # the seven are decoding before the poisoned one fails
        eng.step()
    while eng.has_unfinished():
        eng.step()
    assert eng_seqs[7].finish_reason == "error" and "injected failure" in eng_seqs[7].error
    assert [s.output_ids for s in eng_seqs[:7]] == alone
    assert eng.scheduler.admission_limit is None and not eng.isolation.active
    for s in eng_seqs:
        eng.release(s.request_id)
    assert eng.occupancy()["kv"]["target"]["used"] == 0


def test_llm_generate_reports_the_failed_request(llm):
    outs = llm.generate(PROMPTS[:3] + [[9, 3, 4]], [greedy()] * 3 + [poisoned_temperature()])
    assert [o.finish_reason for o in outs] == ["length"] * 3 + ["error"]
    assert outs[3].error and all(o.error is None for o in outs[:3])
