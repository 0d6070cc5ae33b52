"""Held-out per-position acceptance of an EAGLE-3 drafter, the shipped separate draft and a DSpark
drafter, at the same blocks.

    .venv/bin/python benchmarks/eagle3_acceptance.py EAGLE3_DIR DSPARK_DIR [WINDOWS]   (default 16 windows of 256)

Prints JSON: per position c*_k = 1 - TV(q_k, p_k) and the greedy agreement, the survival
prod_{i<=k} c*_i, the expected accepted tokens per block (all positions, and within 4 drafted
tokens). Blocks: 48 anchors per window, seeded, as `benchmarks/dspark_acceptance.py`; EAGLE-3 drafts
the DSpark drafter's gamma steps.
"""
import json
import sys
import time

from draftwise import corpus
from draftwise.model.dspark import load_dspark
from draftwise.model.eagle3 import load_eagle3
from draftwise.model.loader import load_model
from draftwise.train.data import eval_windows, load_streams
from draftwise.train.dspark_eval import block_acceptance, draft_acceptance
from draftwise.train.eagle3_eval import eagle3_acceptance


def main(eagle3_dir: str, dspark_dir: str, windows: int = 16) -> dict:
    t0 = time.time()
    tl = load_model("models/target", dtype="float32", fuse=False)
    target = tl.model.eval()
    draft = load_model("models/draft", dtype="float32", fuse=False, load_tokenizer=False).model.eval()
    dspark = load_dspark(dspark_dir, target)
    eagle3 = load_eagle3(eagle3_dir, target)
    gamma = dspark.cfg.block_size
    streams = load_streams(tl.tokenizer, corpus.split(), "checkpoints/dspark_eval")
    w = eval_windows(streams["val"], 256, windows)
    out = {"windows": list(w.shape), "eagle3": eagle3_acceptance(eagle3, target, w, 48, gamma),
           "dspark": block_acceptance(dspark, target, w, 48),
           "draft": draft_acceptance(draft, target, w, 48, gamma)}
    for name in ("eagle3", "dspark", "draft"):
        out[name]["expected_accepted_at_4"] = round(sum(out[name]["survival"][:4]), 4)
    out["seconds"] = round(time.time() - t0, 1)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 16), indent=1))
