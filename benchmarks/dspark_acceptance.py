"""Held-out per-position acceptance of a DSpark drafter and the shipped separate draft, same blocks.

    .venv/bin/python benchmarks/dspark_acceptance.py DRAFTER_DIR [WINDOWS]   (default 32 windows of 256 tokens)

Prints JSON: per position c*_k = 1 - TV(q_k, p_k) and the greedy agreement, the survival
prod_{i<=k} c*_i, the expected accepted tokens per block (all gamma, and within 4 drafted tokens:
the verified length of the draft model at k = 4). Blocks: 48 anchors per window, seeded.
"""
import json
import sys
import time

from draftwise import corpus
from draftwise.model.dspark import load_dspark
from draftwise.model.loader import load_model
from draftwise.train.data import eval_windows, load_streams
from draftwise.train.dspark_eval import block_acceptance, draft_acceptance


def main(drafter_dir: str, windows: int = 32) -> dict:
    t0 = time.time()
    tl = load_model("models/target", dtype="float32", fuse=False)
    target = tl.model.eval()
    draft = load_model("models/draft", dtype="float32", fuse=False, load_tokenizer=False).model.eval()
    drafter = load_dspark(drafter_dir, target)
    streams = load_streams(tl.tokenizer, corpus.split(), "checkpoints/dspark_eval")
    w = eval_windows(streams["val"], 256, windows)
    out = {"windows": list(w.shape), "dspark": block_acceptance(drafter, target, w, 48),
           "draft": draft_acceptance(draft, target, w, 48, drafter.cfg.block_size)}
    for name in ("dspark", "draft"):
        out[name]["expected_accepted_at_4"] = round(sum(out[name]["survival"][:4]), 4)
    out["seconds"] = round(time.time() - t0, 1)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 32), indent=1))
