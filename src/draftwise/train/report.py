"""Evaluate the shipped pair on held-out code and write the model card `models/README.md`.

Measured: validation loss (from each model's `training.json`, computed on the whole held-out
stream at the end of training), the target's greedy completions of 64 held-out functions and
their `ast` parse rate, and the draft's acceptance at K = 4, temperature 0 and 1, for the
distilled draft and the cross-entropy-only one (see `evaluate.acceptance_betas`).
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from ..model.loader import load_model
from .. import corpus
from .evaluate import (acceptance_betas, acceptance_summary, cut_function, function_prompts, generate, parses)


def _read(p: Path) -> dict:
    return json.loads(p.read_text()) if p.is_file() else {}


@torch.no_grad()
def _step_seconds(model_dir, n: int = 64) -> float:
    """Seconds per decoding step (batch 1, paged KV cache, draftwise's runner) after a 64-token prompt."""
    from ..model.runner import ModelRunner

    runner = ModelRunner(load_model(model_dir, load_tokenizer=False), num_blocks=16, block_size=16)
    runner.kv.reserve(0, 64 + n + 1)
    ids = torch.randint(1, 8000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    tok = int(runner.run([0], [ids], [0], [1])[0].argmax())
    t0 = time.perf_counter()
    for i in range(n):
        tok = int(runner.run([0], [[tok]], [64 + i], [1])[0].argmax())
    return (time.perf_counter() - t0) / n


def engine_check(models: Path, prompt_ids: list[list[int]], max_new_tokens: int, k: int = 4) -> dict:
    """The same acceptance measured by the engine itself (`draftwise.LLM`, draft proposer, K=k)."""
    from ..engine import SpecConfig
    from ..llm import LLM
    from ..sampling import SamplingParams

    llm = LLM(model=str(models / "target"), draft=str(models / "draft"), spec=SpecConfig(method="draft", k=k))
    res = {"prompts": len(prompt_ids)}
    for temp in (0.0, 1.0):
        outs = llm.generate(prompt_ids, SamplingParams(temperature=temp, max_tokens=max_new_tokens, seed=0))
        rounds = sum(o.stats.rounds for o in outs)
        committed = sum(o.stats.committed_in_rounds for o in outs)
        acc, prop = sum(o.stats.accepted_tokens for o in outs), sum(o.stats.proposed_tokens for o in outs)
        res[f"t{int(temp)}"] = {"rounds": rounds, "mean_accepted_length": round(committed / max(1, rounds), 3),
                                "acceptance_rate": round(acc / max(1, prop), 3)}
    return res


def evaluate_pair(models: str | Path, ce_draft_dir: str | Path | None = None, n_prompts: int = 64,
                  max_new_tokens: int = 128, k: int = 4, engine_prompts: int = 16, log=print,
                  cache_file: str | Path | None = None) -> dict:
    models = Path(models)
    t0 = time.time()
    target = load_model(models / "target", dtype="float32")
    tok = target.tokenizer
    eos = target.eos_token_ids[0]
    split = corpus.split()
    prompts = function_prompts(split, tok, n_prompts)
    prompt_ids = [[eos] + tok.encode(p["prompt"]).ids for p in prompts]
    log(f"{len(prompts)} held-out function prompts; generating with the target")
    res: dict = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "k": k}
    cache = Path(cache_file) if cache_file else None
    if cache is not None and cache.is_file() and torch.load(cache)["prompt_ids"] == prompt_ids:
        completions = torch.load(cache)["completions"]
    else:
        completions = {}
        for temp in (0.0, 1.0):
            completions[temp] = generate(models / "target", prompt_ids, max_new_tokens, temperature=temp, seed=0)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"prompt_ids": prompt_ids, "completions": completions}, cache)
    ok = []
    for p, c in zip(prompts, completions[0.0]):
        text = tok.decode([t for t in c if t != eos])
        ok.append(parses(cut_function(p["prompt"], text)))
    res["ast_parse_rate"] = round(sum(ok) / max(1, len(ok)), 3)
    res["ast_parsed"] = int(sum(ok))
    res["example"] = {"path": prompts[0]["path"], "name": prompts[0]["name"], "prompt": prompts[0]["prompt"],
                      "completion": cut_function("", tok.decode([t for t in completions[0.0][0] if t != eos]))}
    log(f"ast parse rate {res['ast_parse_rate']}")
    drafts = {"distilled": models / "draft"}
    if ce_draft_dir is not None and Path(ce_draft_dir, "config.json").is_file():
        drafts["ce_only"] = Path(ce_draft_dir)
    res["acceptance"] = {}
    for name, d in drafts.items():
        draft = load_model(d, dtype="float32")
        res["acceptance"][name] = {}
        for temp in (0.0, 1.0):
            seqs = [(len(p), p + c) for p, c in zip(prompt_ids, completions[temp]) if c]
            betas = acceptance_betas(target.model, draft.model, seqs, temp)
            res["acceptance"][name][f"t{int(temp)}"] = acceptance_summary(betas, k)
        log(f"{name}: {res['acceptance'][name]}")
    res["val_loss"] = {"target": _read(models / "target" / "training.json").get("val_loss"),
                       "distilled": _read(models / "draft" / "training.json").get("val_loss")}
    if "ce_only" in drafts:
        res["val_loss"]["ce_only"] = _read(drafts["ce_only"] / "training.json").get("val_loss")
    if engine_prompts:
        try:
            res["engine_check"] = engine_check(models, prompt_ids[:engine_prompts], max_new_tokens, k)
            log(f"engine check: {res['engine_check']}")
        except Exception as e:  # the engine is another component; report, do not fail
            res["engine_check"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        ts, ds = _step_seconds(models / "target"), _step_seconds(models / "draft")
        res["decode_step_ms"] = {"target": round(ts * 1e3, 2), "draft": round(ds * 1e3, 2),
                                 "ratio": round(ds / ts, 3)}
    except Exception as e:  # timing is informative only
        res["decode_step_ms"] = {"error": str(e)}
    res["eval_seconds"] = round(time.time() - t0, 1)
    return res


def _total_tokens(t: dict) -> int:
    prev = t.get("continued_from")
    return t.get("tokens", 0) + (_total_tokens(prev) if prev else 0)


def _fmt_acc(a: dict) -> str:
    return f"{a['mean_accepted_length']:.2f} | {a['acceptance_rate']:.3f}"


def write_model_card(models: str | Path, ce_draft_dir=None, total_wall_s: float | None = None,
                     eval_result: dict | None = None, make_models_note: str | None = None) -> dict:
    """Write `eval.json` and the model card `README.md` into `models`; returns the evaluation
    (`eval_result`, or a fresh `evaluate_pair`)."""
    models = Path(models)
    ev = eval_result or evaluate_pair(models, ce_draft_dir)
    (models / "eval.json").write_text(json.dumps(ev, indent=2) + "\n")
    tt = _read(models / "target" / "training.json")
    dt = _read(models / "draft" / "training.json")
    lines = (_overview(models, tt, dt) + _corpus_section(tt.get("corpus", {})) + TOKENIZER_SECTION
             + _speculation_section(ev) + dspark_section(models) + _quality_section(ev) + REPRODUCE_SECTION)
    if make_models_note:
        lines += ["", make_models_note]
    lines += ["", f"Hardware: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
                  f"Python {platform.python_version()}, torch {torch.__version__}."]
    if total_wall_s:
        lines += [f"Wall time of this run of `draftwise train all`: {total_wall_s / 60:.0f} min."]
    (models / "README.md").write_text("\n".join(lines) + "\n")
    return ev


def _shape(cfg: dict) -> str:
    return (f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads "
            f"({cfg['num_key_value_heads']} KV, head dim {cfg['head_dim']}), MLP {cfg['intermediate_size']}, "
            f"{'tied' if cfg['tie_word_embeddings'] else 'untied'} embeddings, context {cfg['max_position_embeddings']}")


def _train_line(t: dict) -> str:
    """One model's training record in a sentence; a warm-started run with its whole history, earliest first."""
    if not t:
        return "n/a"
    hp = t.get("config", {})
    line = (f"{t['tokens']:,} tokens ({t['steps']} steps of {hp.get('batch_size')}x{hp.get('seq_len')}), "
            f"{t['train_seconds'] / 60:.1f} min of training at {t['tokens_per_second']} tokens/s, "
            f"peak RSS {t['peak_rss_mb']} MB, lr {hp.get('lr')} (warm-up {hp.get('warmup_steps')} steps, cosine to 10%)")
    prev = t.get("continued_from")
    if prev:
        total = t["tokens"] + _total_tokens(prev)
        return f"{total:,} tokens in all: {_train_line(prev)}; then, continued from those weights: {line}"
    return line


def _overview(models: Path, tt: dict, dt: dict) -> list[str]:
    """The title, what the pair is for, the side-by-side table of both models and their format."""
    tc = json.loads((models / "target" / "config.json").read_text())
    dc = json.loads((models / "draft" / "config.json").read_text())
    size_mb = sum(f.stat().st_size for f in models.rglob("*") if f.is_file()) / 1e6
    share = dt.get("parameters", 0) / max(1, tt.get("parameters", 1))
    return [
        "# draftwise default models: a Python code target and its distilled draft",
        "",
        "Trained from scratch by `draftwise train` (`make models`) on the Python standard library of the",
        "interpreter that ran the training, on a 2-core CPU with no GPU. They are small and weak in absolute",
        "terms; they exist so that the engine, the server and the lab run out of the box with a real target",
        "and a real drafter trained for it.",
        "",
        "| | target (`models/target`) | draft (`models/draft`) |",
        "|---|---|---|",
        f"| parameters | {tt.get('parameters', 0):,} | {dt.get('parameters', 0):,} ({share:.3f} of the target) |",
        f"| shape | {_shape(tc)} | {_shape(dc)} |",
        f"| objective | next-token cross-entropy | {dt.get('objective', '?')} on the target's next-token distributions |",
        f"| training | {_train_line(tt)} | {_train_line(dt)} |",
        f"| validation loss (held-out, nats/token) | {tt.get('val_loss')} | {dt.get('val_loss')} |",
        "",
        "Format: Hugging Face (`config.json` with `LlamaForCausalLM`, `model.safetensors` in bfloat16,",
        "`tokenizer.json` + `tokenizer_config.json`, `generation_config.json`); `training.json` in each",
        "directory holds the full training record (hyper-parameters, loss history, timings).",
        f"Both directories together: {size_mb:.1f} MB.",
        "",
    ]


def _corpus_section(c: dict) -> list[str]:
    return [
        "## Corpus",
        "",
        f"- Source: the `*.py` files under `sysconfig.get_paths()[\"stdlib\"]` (here `{c.get('root')}`), read",
        "  from disk at training time; never `site-packages`. The regression-test package `test/` and every",
        "  `tests/` and `idle_test/` folder are excluded (they would more than double the corpus with",
        "  repetitive assertions).",
        f"- Split by path (deterministic, `draftwise.train.corpus.HELD_OUT`): {c.get('train_files')} training files",
        f"  ({c.get('train_tokens', 0):,} tokens), {c.get('held_out_files')} held-out files ({c.get('held_out_tokens', 0):,} tokens).",
        "- Held out (whole packages/modules): " + ", ".join(f"`{h}`" for h in c.get("held_out", [])) + ".",
        "- Token stream: `<|endoftext|>` before each file, files in path order; training windows of",
        "  `seq_len + 1` tokens visited in a seeded shuffled order each epoch.",
        "",
    ]


TOKENIZER_SECTION = [
    "## Tokenizer",
    "",
    "Byte-level BPE (`tokenizers`), vocabulary 8192, trained on the training split; one special token",
    "`<|endoftext|>` (id 0), the EOS (and BOS, GPT-2 style; not added automatically). decode(encode(x)) == x",
    "holds on every held-out file (tested). `transformers.AutoTokenizer` loads it.",
    "",
]


def _speculation_section(ev: dict) -> list[str]:
    """Acceptance of each draft at K = 4, how it is computed, the engine's cross-check and the step times."""
    acc = ev["acceptance"]
    rows = []
    for name, label in (("distilled", "distilled (shipped, `models/draft`)"), ("ce_only", "cross-entropy only (not shipped)")):
        if name in acc:
            a0, a1 = acc[name]["t0"], acc[name]["t1"]
            rows.append(f"| {label} | {ev['val_loss'].get(name)} | {_fmt_acc(a0)} | {_fmt_acc(a1)} |")
    lines = [
        "## Speculative decoding on held-out code (K = 4)",
        "",
        f"Prompts: {ev['prompts']} held-out functions (signature + docstring, dedented, preceded by",
        "`<|endoftext|>`), chosen evenly in path order among the held-out functions with a docstring whose",
        "prompt is <= 256 tokens and whose reference body is <= 100 tokens;",
        f"{ev['max_new_tokens']} new tokens from the target.",
        "Mean accepted length = tokens committed per verification round, the target's bonus/correction token",
        "included (K + 1 = 5 at most); acceptance rate = accepted draft tokens / proposed draft tokens.",
        "",
        "| draft | val loss | T=0 mean accepted length | T=0 acceptance rate | T=1 mean accepted length | T=1 acceptance rate |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "How these are computed (`draftwise.train.evaluate`): the target's continuations (greedy for T=0,",
        "sampled with seed 0 for T=1) are scored by one forward pass of target and draft. At T=0 a draft",
        "token is accepted when the draft's argmax equals the target's argmax, and rounds of K proposals are",
        "simulated exactly along the greedy text (at T=0 speculative decoding commits exactly that text).",
        "At T=1 the acceptance probability of position t is sum_x min(p(x), q(x)) (speculative sampling), and",
        "the expected rounds and committed tokens are computed exactly along the sampled text by dynamic",
        "programming over round start positions (this takes the sampled text as the path, an approximation:",
        "tokens accepted from the draft are distributed as min(p, q) rather than p).",
    ]
    eng, step = ev.get("engine_check", {}), ev.get("decode_step_ms", {})
    if "t0" in eng:
        lines += ["", f"Cross-check with the engine itself (`draftwise.LLM`, draft proposer, K = {ev['k']}, first "
                      f"{eng['prompts']} prompts, distilled draft): mean accepted length {eng['t0']['mean_accepted_length']} "
                      f"(acceptance rate {eng['t0']['acceptance_rate']}) at T=0, {eng['t1']['mean_accepted_length']} "
                      f"({eng['t1']['acceptance_rate']}) at T=1 (one seeded sample)."]
    if "ratio" in step:
        lines += ["", f"Decoding step, batch 1 with KV cache (draftwise runner, fp32, this machine): target "
                      f"{step['target']} ms, draft {step['draft']} ms (ratio {step['ratio']})."]
    return lines


def _quality_section(ev: dict) -> list[str]:
    """The target's greedy completions: how many parse, and one example."""
    return [
        "",
        "## Target quality",
        "",
        f"Greedy completions of the same {ev['prompts']} held-out functions ({ev['max_new_tokens']} new tokens, cut at",
        "the end of the function's indentation block, i.e. at the first non-blank line at column 0):",
        f"**{ev['ast_parsed']}/{ev['prompts']} ({100 * ev['ast_parse_rate']:.0f}%) parse with `ast`**.",
        "The prompt ends at the docstring's closing quotes: with byte-level BPE a newline is merged with",
        "the next line's indentation, so a prompt ending in a bare newline makes the model start a new",
        "top-level definition instead of the body (with it, 0 of 64 bodies were even started).",
        "",
        f"Example (`{ev['example']['path']}`, `{ev['example']['name']}`), prompt then greedy completion:",
        "",
        "```python",
        ev["example"]["prompt"] + ev["example"]["completion"].rstrip(),
        "```",
        "",
    ]


def dspark_section(models: Path) -> list[str]:
    """The DSpark drafter `models/dspark` (when `train all` made one) from its training.json: what it
    is, its training, its held-out acceptance by block position and its calibration."""
    t = _read(Path(models) / "dspark" / "training.json")
    if not t:
        return []
    cfg = json.loads((Path(models) / "dspark" / "config.json").read_text())
    acc, cal = t.get("held_out", {}), t.get("calibration", {})
    fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    hp = t.get("config", {})
    return [
        "## DSpark drafter (`models/dspark`)",
        "",
        f"A drafter on the target's own features (docs/ARCHITECTURE.md, \"DSpark\"): it reads the target's layers "
        f"{', '.join(str(i) for i in cfg['target_feature_layers'])} (0-based), shares its embeddings and LM head, and "
        f"proposes a block of {cfg['block_size']} tokens per forward ({cfg['num_hidden_layers']} backbone layer, "
        f"{cfg['markov_head_type']} Markov head of rank {cfg['markov_rank']}, a confidence head); "
        f"{t.get('trainable_parameters', 0):,} parameters of its own. `--method dspark` uses it by default with the "
        "embedded target.",
        "",
        f"Training: {t.get('objective', '?')}; {t.get('tokens', 0):,} tokens ({t.get('steps')} steps of "
        f"{hp.get('batch_size')}x{hp.get('seq_len')}, {t.get('anchors_per_window')} blocks a window), "
        f"{t.get('train_seconds', 0) / 60:.1f} min at {t.get('tokens_per_second')} tokens/s, lr {hp.get('lr')}; "
        "the target's one forward gives the features and p (no generation).",
        "",
        f"Held out ({acc.get('blocks', 0):,} blocks of {cfg['block_size']}, teacher-forced): acceptance of a sampled "
        f"proposal c*_k = 1 - TV(q_k, p_k) by block position {fmt(acc.get('per_position', []))}; greedy agreement "
        f"{fmt(acc.get('greedy_per_position', []))}; tokens expected accepted from a block "
        f"{acc.get('expected_accepted', 0):.2f} sampled, {acc.get('greedy_accepted', 0):.2f} greedy. Confidence "
        f"after Sequential Temperature Scaling: ECE of the cumulative survival "
        f"{cal.get('after', {}).get('ece', 0):.1%} on other held-out windows "
        f"({cal.get('before', {}).get('ece', 0):.1%} before).",
        "",
    ]


REPRODUCE_SECTION = [
    "## Reproduce",
    "",
    "```",
    "make models      # = draftwise train all --out models --draft-continue-minutes 100 --dspark-minutes 40 (...)",
    "# or step by step:",
    "draftwise train tokenizer --out checkpoints/tokenizer",
    "draftwise train target --out models/target --tokenizer checkpoints/tokenizer --minutes 80",
    "draftwise train draft --target models/target --out models/draft --minutes 15 --warmup 50",
    "draftwise train draft --target models/target --out checkpoints/draft_ce_model --ce-only --tokens N  # N: the distilled draft's tokens",
    "# then both continue from their weights (fresh optimizer and schedule; M: the distilled run's tokens):",
    "draftwise train draft --target models/target --out models/draft --init models/draft --minutes 100 \\",
    "    --lr 1.5e-3 --warmup 20 --seed 1 --ckpt-dir checkpoints/draft_long",
    "draftwise train draft --target models/target --out checkpoints/draft_ce_model --init checkpoints/draft_ce_model \\",
    "    --ce-only --tokens M --lr 1.5e-3 --warmup 20 --seed 1 --ckpt-dir checkpoints/draft_ce_long",
    "# the DSpark drafter (train all writes its weights in bfloat16):",
    "draftwise train dspark --target models/target --out models/dspark --ckpt-dir checkpoints/dspark --minutes 40",
    "```",
    "",
    "Checkpoints (model, optimizer, RNG, data position, elapsed time) are written to `checkpoints/` every",
    "3 minutes; rerun with `--resume` after an interruption. With a `--minutes` budget the cosine schedule",
    "follows the measured training time, so the result depends on the machine's speed; `--tokens N`",
    "gives a step-deterministic run.",
]
