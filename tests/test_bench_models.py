"""Drafters of several kinds side by side in one bench run (lab/bench_models.py): each config's
drafter from its `:draft=DIR`, else --draft, else the embedded one of its method; each directory
loaded once; the draft's own options applied where they fit; clear errors otherwise."""
import json
from types import SimpleNamespace

import pytest

from draftwise.cli.main import main
from draftwise.lab.bench_models import draft_dirs, load_bench_models
from draftwise.lab.runner import parse_configs
from draftwise.model.pair import LoadedDSpark
from draftwise.paths import default_draft
from test_dspark_engine import make_dspark_dir


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory, target_dir):
    return make_dspark_dir(tmp_path_factory.mktemp("dspark"), target_dir)


def plan(model=None, draft=None, **kw):
    return SimpleNamespace(model=model, draft=draft, dtype="float32", draft_dtype=None, device="cpu",
                           quantization=None, draft_quantization=kw.get("dq"), draft_vocab=kw.get("dv"))


def drafting(text):
    return [c for c in parse_configs(text) if c.method in ("draft", "dspark", "eagle3")]


def test_parse_draft_option():
    cfgs = {c.label: c for c in parse_configs("none,draft:k=4,dspark:k=4:draft=/x/ds,draft:k=4:draft=d2:copy=2")}
    assert cfgs["dspark:k=4:draft=/x/ds"].draft == "/x/ds" and cfgs["draft:k=4"].draft is None
    assert cfgs["draft:k=4:draft=d2:copy=2"].draft == "d2"
    for bad, msg in (("ngram:k=4:draft=x", "ngram drafts without one"), ("none:draft=x", "none drafts nothing"),
                     ("draft:k=4:draft=", "--configs entries look like")):
        with pytest.raises(ValueError, match=msg):
            parse_configs(bad)


def test_each_configs_directory():
    cfgs = drafting("none,draft:k=4,dspark:k=4,dspark:k=2:draft=mine,ngram:k=4")
    embedded = draft_dirs(plan(), cfgs)  # the embedded target: the embedded drafter of each method
    assert embedded == {"draft:k=4": str(default_draft("draft")), "dspark:k=4": str(default_draft("dspark")),
                        "dspark:k=2:draft=mine": "mine"}
    given = draft_dirs(plan(model="t", draft="d"), cfgs)  # --draft: every config without its own
    assert given == {"draft:k=4": "d", "dspark:k=4": "d", "dspark:k=2:draft=mine": "mine"}
    with pytest.raises(ValueError, match=r"'draft' needs a draft model directory \(--draft DIR, or draft:...:draft=DIR"):
        draft_dirs(plan(model="t"), cfgs)


def test_loads_each_directory_once(target_dir, draft_dir, dspark_dir):
    cfgs = drafting(f"none,draft:k=4,draft:k=2,dspark:k=4:draft={dspark_dir}")
    models = load_bench_models(plan(model=str(target_dir), draft=str(draft_dir)), cfgs)
    assert models.draft("draft:k=4") is models.draft("draft:k=2")  # one load of the draft model
    assert isinstance(models.draft(f"dspark:k=4:draft={dspark_dir}"), LoadedDSpark)
    assert models.draft("none") is None
    # the draft's own options go to the drafters they fit: --draft-vocab prunes the draft model's head
    # and the DSpark drafter's drafting head, --draft-quantization the draft model only
    models = load_bench_models(plan(model=str(target_dir), draft=str(draft_dir), dv=64), cfgs)
    assert type(models.draft("draft:k=4").model.lm_head).__name__ == "PrunedHead"
    assert len(models.draft(f"dspark:k=4:draft={dspark_dir}").model.kept_head.kept) == 64
    with pytest.raises(ValueError, match="--draft-quantization applies to a draft model, not to a DSpark"):
        load_bench_models(plan(model=str(target_dir), dq="int8"), drafting(f"dspark:k=4:draft={dspark_dir}"))
    with pytest.raises(ValueError, match="--draft-vocab applies to a draft model; no config of this run loads one"):
        load_bench_models(plan(model=str(target_dir), dv=64), drafting("none,ngram:k=4"))


def test_draft_model_and_dspark_side_by_side(tmp_path, target_dir, draft_dir, dspark_dir, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--model", str(target_dir), "--draft", str(draft_dir), "--configs",
                 f"none,draft:k=4,dspark:k=4:draft={dspark_dir}", "--workload", "grounded", "--concurrency", "2",
                 "--num-requests", "3", "--max-tokens", "8", "--time-slice", "20", "--out", str(out),
                 "--no-progress"]) == 0
    runs = {r["config"]: r for r in json.loads((out / "results.json").read_text())["workloads"][0]["runs"]}
    for label, method in (("draft:k=4", "draft"), (f"dspark:k=4:draft={dspark_dir}", "dspark")):
        r = runs[label]
        assert r["method"] == method and r["completed"] == 3 and r["speculation"]["proposed_tokens"] > 0
        assert r["correctness"]["mismatching_requests"] == 0
    assert main(["bench", "--model", str(target_dir), "--configs", "none,dspark:k=4", "--workload", "grounded",
                 "--num-requests", "1", "--no-progress"]) == 2
    assert "needs a draft model directory" in capsys.readouterr().err
