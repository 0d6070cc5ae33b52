"""Speculation on an attention target and on a hybrid target, and the hybrid's two recurrent
rollback strategies side by side: time per committed token split into drafting, verification,
rollback (the recurrent-state commit: snapshot copy or replay) and the rest; the recurrent
scratch memory of each strategy.

    .venv/bin/python benchmarks/hybrid_rollback.py --targets attention=target,hybrid=PATH [--draft draft]
        [--method draft] [--k 4] [--concurrency 1,4,16] [--requests 16] [--max-tokens 64]
        [--workload code-easy] [--threads 2] [--out FILE.md]

`--method oracle` proposes plain decoding's own continuation with one token in k+1 positions
corrupted (the position moves with the output length): the same acceptance on every target, so
that the speedups compare the targets' verification and rollback costs, not their drafts.

For each target: plain decoding, then speculation (for a hybrid target once per strategy), each in
one engine per concurrency level (`max_num_seqs = c`, the requests all queued at once), greedy.
Outputs are checked equal to plain decoding's. Time per committed token (ms) = wall / committed;
its parts come from `EngineStats` (propose, verify, rollback seconds; the rest is scheduling,
sampling rules, postprocess and Python). Scratch: the largest provisional scratch one forward
kept (`RecurrentStatePool.peak_scratch_bytes`), and the size of one sequence's checkpoint.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.lab.workload import load_workload
from draftwise.proposers import DraftBlock, register_proposer

ORACLE: dict[tuple, list[int]] = {}  # prompt ids -> plain greedy output (filled by the plain run)


@register_proposer("oracle")
class OracleProposer:
    kv = None
    needs_draft_model = False

    def __init__(self, target=None, **_):
        self.vocab = target.config.vocab_size

    def propose(self, seqs, num_draft, num_forced=None):
        blocks = []
        for s, n in zip(seqs, num_draft):
            j = len(s.output_ids)
            block = list(ORACLE.get(tuple(s.prompt_ids), [])[j : j + n])
            c = (3 * j + 1) % (n + 1)
            if c < len(block):
                block[c] = (block[c] + 1) % self.vocab
            blocks.append(DraftBlock(block, None))
        return blocks

    def postprocess(self, seq, block, num_accepted, num_tokens_before):
        pass

    def finish(self, seq):
        pass


def run(llm: LLM, prompts: list[str], sp: SamplingParams) -> dict:
    eng = llm.engine
    st = eng.stats
    before = (st.propose_seconds, st.verify_seconds, st.rollback_seconds, st.rounds, st.committed_tokens,
              st.accepted_tokens, st.proposed_tokens, st.decode_steps)
    t0 = time.perf_counter()
    seqs = [eng.add_request(f"r{time.perf_counter_ns()}-{i}", p, sp) for i, p in enumerate(prompts)]
    while eng.has_unfinished():
        eng.step()
    wall = time.perf_counter() - t0
    outs = [list(s.output_ids) for s in seqs]
    if eng.proposer is None:
        ORACLE.update({tuple(s.prompt_ids): list(s.output_ids) for s in seqs})
    for s in seqs:
        eng.release(s.request_id)
    d = [a - b for a, b in zip((st.propose_seconds, st.verify_seconds, st.rollback_seconds, st.rounds,
                                st.committed_tokens, st.accepted_tokens, st.proposed_tokens, st.decode_steps), before)]
    committed = sum(len(o) for o in outs)
    pool = eng.runner.state
    return {"outs": outs, "wall": wall, "committed": committed, "propose": d[0], "verify": d[1], "rollback": d[2],
            "rounds": d[3], "accepted": d[5], "proposed": d[6], "decode_steps": d[7],
            "scratch": pool.peak_scratch_bytes if pool is not None else 0,
            "state": pool.state_bytes() if pool is not None else 0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", required=True, help="name=dir,name=dir")
    ap.add_argument("--draft", default="draft")
    ap.add_argument("--method", default="draft")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--workload", default="code-easy")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    prompts = [r.prompt for r in load_workload(a.workload).requests][: a.requests]
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    levels = [int(c) for c in a.concurrency.split(",")]
    lines = [f"load before: {os.getloadavg()[0]:.2f}; threads {a.threads}; {len(prompts)} requests of "
             f"{a.max_tokens} tokens ({a.workload}); method {a.method}, k={a.k}", "",
             "| target | config | c | ms/token | draft | verify | rollback | rest | speedup | mean acc. len | "
             "rollback / verify step | scratch (KiB) | state/seq (KiB) | equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for item in a.targets.split(","):
        name, path = item.split("=", 1)
        plain_llm = LLM(path)
        hybrid = plain_llm.engine.target.config.hybrid is not None
        configs = [("none", None)] + ([(f"{a.method}:k={a.k}:{r}", r) for r in ("snapshot", "replay")] if hybrid
                                      else [(f"{a.method}:k={a.k}", "snapshot")])
        for c in levels:
            base = None
            for label, rollback in configs:
                if rollback is None:
                    llm = LLM(path, max_num_seqs=c)
                else:
                    llm = LLM(path, draft=a.draft if a.method == "draft" else None,
                              spec=SpecConfig(method=a.method, k=a.k), max_num_seqs=c, recurrent_rollback=rollback)
                run(llm, prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
                r = run(llm, prompts, sp)
                if base is None:
                    base = r
                ms = 1e3 / r["committed"]
                rest = r["wall"] - r["propose"] - r["verify"] - r["rollback"]
                mal = (r["accepted"] + r["rounds"]) / r["rounds"] if r["rounds"] else 1.0
                rb = r["rollback"] / r["verify"] if r["verify"] and r["rollback"] else 0.0
                lines.append(
                    f"| {name} | {label} | {c} | {r['wall'] * ms:.2f} | {r['propose'] * ms:.2f} | {r['verify'] * ms:.2f} "
                    f"| {r['rollback'] * ms:.3f} | {rest * ms:.2f} | {base['wall'] / r['wall']:.2f}x | {mal:.2f} "
                    f"| {rb:.3f} | {r['scratch'] / 1024:.0f} | {r['state'] / 1024:.0f} | {r['outs'] == base['outs']} |")
                print(lines[-1], flush=True)
    lines.append("")
    lines.append(f"load after: {os.getloadavg()[0]:.2f}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
