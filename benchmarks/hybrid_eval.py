"""The hybrid target beside the attention target, with the shipped draft: what models/README.md
reports for it (held-out validation loss, ast parse rate of greedy completions, the engine's
mean accepted length at T=0 and T=1, K=4).

    .venv/bin/python benchmarks/hybrid_eval.py --targets attention=target,hybrid=hybrid [--draft draft]
        [--prompts 16] [--max-tokens 128] [--threads 2]

Prompts: the first `--prompts` of the model card's held-out function prompts
(`train.evaluate.function_prompts`, 64 chosen evenly; signature + docstring, after EOS).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.corpus import split as corpus_split
from draftwise.paths import resolve_model
from draftwise.train.evaluate import cut_function, function_prompts, parses


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", required=True)
    ap.add_argument("--draft", default="draft")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"load before: {os.getloadavg()[0]:.2f}")
    rows = []
    for item in a.targets.split(","):
        name, path = item.split("=", 1)
        plain = LLM(path)
        tok, eos = plain.tokenizer, plain.engine.eos_ids[0]
        prompts = function_prompts(corpus_split(), tok, 64)[: a.prompts]
        ids = [[eos] + tok.encode(p["prompt"]).ids for p in prompts]
        greedy = plain.generate(ids, SamplingParams(temperature=0, max_tokens=a.max_tokens))
        ok = sum(parses(cut_function(p["prompt"], tok.decode([t for t in o.token_ids if t != eos])))
                 for p, o in zip(prompts, greedy))
        spec = LLM(path, draft=a.draft, spec=SpecConfig(method="draft", k=4))
        row = {"target": name, "val_loss": json.loads(Path(resolve_model(path), "training.json").read_text())
               .get("val_loss"), "ast_parsed": f"{ok}/{len(prompts)}"}
        for temp in (0.0, 1.0):
            outs = spec.generate(ids, SamplingParams(temperature=temp, max_tokens=a.max_tokens, seed=0))
            if temp == 0.0:
                row["greedy_equal"] = [o.token_ids for o in outs] == [o.token_ids for o in greedy]
            rounds = sum(o.stats.rounds for o in outs)
            row[f"mean_accepted_length_t{int(temp)}"] = round(sum(o.stats.committed_in_rounds for o in outs) / rounds, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
