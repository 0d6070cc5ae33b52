"""`draftwise check` certifies a hybrid target (gated delta rule + attention) with an attention-only
draft, for both recurrent rollback strategies: greedy equality, the chi-square distribution test
at temperature 1 through the engine, rollback (logits read through the committed K/V and
recurrent state equal a fresh forward) and stops. `generate --recurrent-rollback` runs."""
import json

import pytest

from draftwise.cli.main import main
from tiny_hybrid import make_hybrid_dir


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory, tokenizer):
    return make_hybrid_dir(tmp_path_factory.mktemp("hybrid_check"), seed=7, tokenizer=tokenizer)


# replay's greedy equality and rollback exactness are in test_hybrid_speculative.py; its certificate
# (~11 s on 2 loaded cores) runs with -m slow
@pytest.mark.parametrize("rollback", ["snapshot", pytest.param("replay", marks=pytest.mark.slow)])
def test_check_certifies_a_hybrid_pair(hybrid_dir, draft_dir, rollback, capsys):
    rc = main(["check", "--model", str(hybrid_dir), "--draft", str(draft_dir), "--k", "3", "--samples", "200",
               "--max-tokens", "12", "--recurrent-rollback", rollback])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("greedy equality", "distribution", "KV rollback", "stops inside accepted blocks"):
        assert f"PASS {name}" in out


def test_generate_flag(hybrid_dir, capsys):
    args = ["generate", "def f(x):", "--model", str(hybrid_dir), "--method", "ngram", "--k", "3",
            "--max-tokens", "8", "--temperature", "0", "--json"]
    outs = []
    for rollback in ("snapshot", "replay"):
        assert main(args + ["--recurrent-rollback", rollback]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 8
    with pytest.raises(SystemExit) as e:
        main(args + ["--recurrent-rollback", "copy"])
    assert e.value.code == 2
    assert "--recurrent-rollback" in capsys.readouterr().err


def test_profile_of_a_hybrid_pair(hybrid_dir, tmp_path):
    """The hardware profile times a hybrid target (and a hybrid drafter) at contexts it never
    prefilled: recurrent states placed at that context, verification blocks provisional."""
    from draftwise.model import load_model
    from draftwise.policies.profile import measure_profile

    target = load_model(hybrid_dir)
    prof = measure_profile(target, target, max_num_seqs=2, k=2, contexts=(16, 32), budget_seconds=2, repeats=1)
    assert prof.grid and prof.draft_grid and all(p.seconds > 0 for p in prof.grid)
    assert any(p.tokens_per_seq > 1 for p in prof.grid)  # verification blocks were timed too


def test_bench_config_rollback():
    from draftwise.lab.runner import parse_configs

    cfgs = {c.label: c for c in parse_configs("draft:k=4,draft:k=4:rollback=replay")}
    assert cfgs["draft:k=4"].rollback == "snapshot" and cfgs["draft:k=4:rollback=replay"].rollback == "replay"
    with pytest.raises(ValueError, match="rollback=replay"):
        parse_configs("draft:k=4:rollback=copy")
