"""What n-gram lookup can commit per round on a workload, whatever the matcher: replayed offline
on the model's own greedy replies.

    .venv/bin/python benchmarks/ngram_bound.py --model smollm2 --workload chat-grounded,chat-open \
        [--max-tokens 64] [--k 4,8] [--threads 2]

The model's greedy replies to the workload's prompts (the chat template applied, as the lab
does) are generated once with plain decoding; then every round of speculative decoding is
replayed on them: a matcher proposes up to k tokens from the history (prompt + reply so far), the
longest prefix equal to the reply is accepted, plus the target's own token (greedy: exactly what
the engine would commit, without the engine's cost). Matchers:

- `lookup`: draftwise's `ngram` proposer (the most recent earlier occurrence of the longest
  suffix of at most 4 tokens, down to 1);
- `longest`: the earlier occurrence whose match with the history's suffix runs longest (up to
  64 tokens back), the most recent on ties;
- `longest>=2`, `longest>=3`: the same, proposing nothing below a match of 2 (3) tokens;
- `vote`: among the occurrences of the longest suffix (<= 3 tokens), the continuation most of
  them agree on.

Tokens per round here bound what any verification policy can make of the matcher: a policy only
chooses to verify fewer of its proposals. Divided by a round's cost in plain steps (the lab's ITL
of a speculative round over `none`'s), it bounds n-gram lookup's decode speedup on the machine.
"""
from __future__ import annotations

import argparse
from collections import Counter

import numpy as np
import torch

from draftwise import LLM
from draftwise.lab.workload import load_workload
from draftwise.model.chat_template import ChatTemplate
from draftwise.proposers.ngram import MATCH_CAP, ngram_lookup
from draftwise.sampling import SamplingParams


def lookup(h: list[int], k: int) -> list[int]:
    return ngram_lookup(h, k, 4, 1)


def longest(h: list[int], k: int, min_match: int = 1) -> list[int]:
    arr = np.asarray(h)
    L = len(arr)
    best, best_m = None, 0
    for i in np.nonzero(arr[: L - 1] == arr[-1])[0][::-1]:  # earlier positions ending like the history
        m = 1
        while m < MATCH_CAP and i - m >= 0 and arr[i - m] == arr[L - 1 - m]:
            m += 1
        if m > best_m:
            best, best_m = int(i), m
    if best is None or best_m < min_match:
        return []
    return arr[best + 1 : best + 1 + k].tolist()


def vote(h: list[int], k: int, max_n: int = 3) -> list[int]:
    arr = np.asarray(h)
    L = len(arr)
    for n in range(min(max_n, L - 1), 0, -1):
        pat = arr[L - n :]
        starts = [int(i) for i in np.nonzero(arr[: L - n] == pat[0])[0] if np.array_equal(arr[i : i + n], pat)]
        if starts:
            tok = Counter(int(arr[i + n]) for i in starts).most_common(1)[0][0]
            i = max(i for i in starts if arr[i + n] == tok)
            return arr[i + n : i + n + k].tolist()
    return []


MATCHERS = {
    "lookup": lookup,
    "longest": longest,
    "longest>=2": lambda h, k: longest(h, k, 2),
    "longest>=3": lambda h, k: longest(h, k, 3),
    "vote": vote,
}


def replay(matcher, k: int, pairs: list[tuple[list[int], list[int]]]) -> tuple[int, int]:
    """(rounds, tokens) of speculative greedy decoding of `pairs` (prompt ids, reply ids)."""
    rounds = tokens = 0
    for prompt, reply in pairs:
        t = 0
        while t < len(reply):
            prop = matcher(prompt + reply[:t], k)
            a = 0
            while a < len(prop) and t + a < len(reply) and prop[a] == reply[t + a]:
                a += 1
            c = min(a + 1, len(reply) - t)
            t += c
            rounds += 1
            tokens += c
    return rounds, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--workload", default="chat-grounded,chat-open")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", default="4,8")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model)
    target = llm.engine.target
    chat = ChatTemplate(target.tokenizer_config)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    ks = [int(v) for v in args.k.split(",")]
    print(f"| workload | matcher | " + " | ".join(f"tokens / round, k={k}" for k in ks) + " |")
    print("|---|---|" + "---|" * len(ks))
    for name in args.workload.split(","):
        reqs = load_workload(name).requests
        prompts = [target.tokenizer.encode(r.render_prompt(chat), add_special_tokens=not r.messages).ids for r in reqs]
        replies = [o.token_ids for o in llm.generate(prompts, sp)]
        pairs = list(zip(prompts, replies))
        for mname, m in MATCHERS.items():
            cells = []
            for k in ks:
                rounds, tokens = replay(m, k, pairs)
                cells.append(f"{tokens / rounds:.2f} ({rounds} rounds, {tokens} tokens)")
            print(f"| {name} | {mname} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
