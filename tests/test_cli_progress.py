"""Progress bars of long commands: on stderr only, drawn when forced (--progress) even into a pipe,
absent by default when stderr is not a terminal; stdout stays plain text either way."""
import json

import torch

from draftwise.cli.main import main
from draftwise.lab.progress import make_progress, stderr_console, wanted
from draftwise.train.data import Batches
from draftwise.train.shapes import PRESETS, build_model, llama_config
from draftwise.train.trainer import TrainConfig, Trainer

ESC = "\x1b"


def test_the_mode_decides_and_a_disabled_bar_still_counts(capsys):
    assert wanted(True) and not wanted(False)
    assert not wanted(None)  # pytest's captured stderr is no terminal
    with make_progress(stderr_console(None), None) as bar:
        task = bar.add_task("x", total=3)
        bar.advance(task)
        assert bar.tasks[0].completed == 1
    assert capsys.readouterr().err == ""


def test_check_quick_with_forced_progress(target_dir, draft_dir, capsys):
    """--quick with an explicit --samples (the explicit option wins): the bar counts the planned
    requests on stderr; stdout holds the header, the results and their explanations, no escapes."""
    argv = ["check", "--model", str(target_dir), "--draft", str(draft_dir), "--k", "3", "--quick", "--samples", "300"]
    assert main(argv + ["--progress"]) == 0
    cap = capsys.readouterr()
    total = 2 * 3 + 3 * 3 * 300 + 3 + 21  # greedy, distribution, rollback, stops (at most)
    assert f"/{total}" in cap.err and "ETA" in cap.err and ESC in cap.err
    out = cap.out
    assert ESC not in out
    assert "3 prompts (--quick)" in out.splitlines()[0]
    for name in ("greedy equality", "distribution (T=1)", "KV rollback", "stops inside accepted blocks"):
        assert f"PASS {name}: " in out
    assert out.count("    threshold: ") == 4 and out.count("    why PASS: ") == 4
    # the distribution line: the verdict's figures, then TV next to the TV of sampling noise
    dist = next(line for line in out.splitlines() if line.startswith("PASS distribution"))
    assert "alpha=0.01 over 6 chi-square tests" in dist and "sampling noise alone: " in dist
    flat = " ".join(out.split())  # explanations are wrapped to the console's width
    assert "300 samples of the first 2 tokens" in flat and "two plain runs with different seeds" in flat

    assert main(argv + ["--max-tokens", "8"]) == 0  # stderr no terminal, no --progress: no bar
    cap = capsys.readouterr()
    assert "ETA" not in cap.err and ESC not in cap.err and "PASS greedy equality" in cap.out


def test_train_bar_goes_to_stderr_only_when_asked(tmp_path, capsys):
    stream = torch.randint(0, 64, (2000,), generator=torch.Generator().manual_seed(0)).to(torch.int16)

    def trainer(progress):
        model = build_model(llama_config(PRESETS["tiny"], 64, 0), seed=0)
        cfg = TrainConfig(ckpt_dir=str(tmp_path / str(progress)), batch_size=2, seq_len=16, warmup_steps=2,
                          max_tokens=4 * 2 * 16, log_every_s=1e9, ckpt_every_s=1e9)
        return Trainer(model, Batches(stream, 2, 16, seed=3), cfg, log=lambda m: None, progress=progress)

    trainer(True).run()
    cap = capsys.readouterr()
    assert "4/4" in cap.err and ESC in cap.err and cap.out == ""
    trainer(None).run()
    cap = capsys.readouterr()
    assert cap.err == "" and cap.out == ""


def test_profile_bar_leaves_stdout_parseable(target_dir, tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(["profile", "--model", str(target_dir), "--method", "none", "--max-num-seqs", "1", "--k", "1",
               "--contexts", "8", "--budget", "2", "--repeats", "1", "--out", str(out), "--progress"])
    assert rc == 0
    cap = capsys.readouterr()
    assert "ETA" in cap.err and ESC not in cap.out and "median relative error" in cap.out
    assert json.loads(out.read_text())["grid"]
