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
    real = engine_mod.rejection_sample

    def accept_everything(draft_ids, draft_probs, target_probs, generators, num_draft_tokens, is_greedy=None):
        committed, _ = real(draft_ids, draft_probs, target_probs, generators, num_draft_tokens=num_draft_tokens,
                            is_greedy=is_greedy)
        lossy = committed.clone()
        for b, n in enumerate(num_draft_tokens.tolist()):
            lossy[b, :n] = draft_ids[b, :n]  # every proposal kept, right or wrong
            lossy[b, n] = committed[b, 0]  # any valid token as the bonus
        return lossy, num_draft_tokens.clone()

    def greedy_accept_everything(draft_ids, target_argmax):  # greedy rows' path
        return list(draft_ids) + [int(target_argmax[0])], len(draft_ids)

    monkeypatch.setattr(engine_mod, "rejection_sample", accept_everything)
    monkeypatch.setattr(engine_mod, "greedy_accept", greedy_accept_everything)
    rc = main(["check", "--model", str(target_dir), "--draft", str(draft_dir),
               "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL greedy equality" in out and "FAIL distribution" in out
