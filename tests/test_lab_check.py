"""`draftwise check` on the tiny models: PASS for a correct engine, FAIL (exit 1) for a lossy one."""
import draftwise.engine.engine as engine_mod
from draftwise.cli.main import main


def test_check_passes(target_dir, draft_dir, capsys):
    rc = main(["check", "--model", str(target_dir), "--draft", str(draft_dir), "--k", "3", "--samples", "300",
               "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("greedy equality", "distribution", "KV rollback", "stops inside accepted blocks"):
        assert f"PASS {name}" in out


def test_check_ngram_passes_with_own_prompts(target_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\\n    return a + b\\n\\ndef add(a, b):\nfor i in range(10):\n")
    rc = main(["check", "--model", str(target_dir), "--method", "ngram", "--samples", "200", "--max-tokens", "16",
               "--prompts", str(prompts)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "2 prompts" in out
    assert main(["check", "--model", str(target_dir), "--method", "none"]) == 2
    assert main(["check", "--model", str(target_dir), "--method", "ngram", "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert "file not found" in capsys.readouterr().err


def test_check_fails_on_a_lossy_sampler(target_dir, draft_dir, capsys, monkeypatch):
    real = engine_mod.verify_proposals

    def accept_everything(p_logits, meta, q, generators=None, draws=None):
        res = real(p_logits, meta, q, generators, draws)
        lossy = res.committed.clone()
        for b, n in enumerate(meta.num_draft.tolist()):
            lossy[b, :n] = meta.draft_token_ids[b, :n]  # every proposal kept, right or wrong
            lossy[b, n] = res.committed[b, 0]  # any valid token as the bonus
        return type(res)(lossy, meta.num_draft.clone(), res.valid)

    real_argmax = engine_mod.verify_argmax

    def accept_every_greedy(logits, draft_token_ids):  # greedy rows' own path: the same fault
        toks, _, valid = real_argmax(logits, draft_token_ids)
        return ([list(d) + t[:1] for d, t in zip(draft_token_ids, toks)], [len(d) for d in draft_token_ids], valid)

    monkeypatch.setattr(engine_mod, "verify_proposals", accept_everything)
    monkeypatch.setattr(engine_mod, "verify_argmax", accept_every_greedy)
    rc = main(["check", "--model", str(target_dir), "--draft", str(draft_dir),
               "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL greedy equality" in out and "FAIL distribution" in out


def test_rollback_reference_for_quantized_weights_takes_the_runners_products(target_dir, draft_dir, capsys):
    """Quantized weights: the fresh reference is the runner's own prefill (the same products as the
    cached path); a stale cache still shows (its K/V zeroed: far outside the tolerance)."""
    from draftwise import LLM, SamplingParams
    from draftwise.lab.check import _cached_next_logits, _fresh_next_logits

    rc = main(["check", "--model", str(target_dir), "--draft", str(draft_dir), "--k", "3", "--samples", "300",
               "--max-tokens", "16", "--quantization", "int8"])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS KV rollback" in out, out
    llm = LLM(str(target_dir), quantization="int8")
    eng = llm.engine
    seq = eng.add_request("r", [5, 17, 42, 99, 7, 60], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while not seq.is_finished and len(seq.output_ids) < 5:
        eng.step()
    ids = seq.all_ids
    fresh = _fresh_next_logits(eng.runner, eng.target.model, ids)
    got = _cached_next_logits(eng.runner, seq.seq_id, ids, seq.num_computed).float()
    assert float((got - fresh).abs().max()) <= 1e-4 * max(1.0, float(fresh.abs().max()))
    eng.runner.cache.zero_()
    stale = _cached_next_logits(eng.runner, seq.seq_id, ids, seq.num_computed).float()
    assert float((stale - fresh).abs().max()) > 1e-2 * max(1.0, float(fresh.abs().max()))
