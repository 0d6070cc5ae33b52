"""How much can a second sibling add at one slot of a sampled tree? Per-slot acceptance of a
draft for a target, on the target's own sampled replies, under each verification rule.

    .venv/bin/python benchmarks/tree_headroom.py [--target target] [--draft draft]
        [--workload code-hard] [--requests 8] [--tokens 96] [--temperature 1.0] [--seed 1]

The target samples its replies to the workload's prompts (plain decoding, `--temperature`); then
one full forward of each model over prompt + reply gives p (target) and q (draft) at every reply
position, after the temperature. At each slot, with x1, x2 drawn from q without replacement:

- `one draw`: 1 - TV(p, q), a chain's acceptance;
- `two draws, recursive rejection`: accept x1 with min(1, p/q); else the residual
  p1 = norm((p - q)+) against x2 drawn from q without x1 (what draftwise's sampled trees verify,
  sampling/tree.py): the exact expectation over x1 among q's 64 most probable tokens (renormalised);
- `two draws, select the higher p/q`: one of the two picked by p/q, then one speculative-sampling
  step against the picked token's marginal r (exact for any selection rule; r in O(V log V));
- `bound`: the min-cut value over threshold sets H (tokens ranked by p / P(x among the draws)):
  p(not H) + P(a draw in H) bounds any verification of two draws from above;
- `point masses`: p of q's top-1 and top-1 + top-2 (deterministic siblings, verified as point masses).

With `--temperature 0` the replies are greedy and a slot reports how often q's argmax is the
target's, how often its runner-up is (what a greedy tree's sibling leaf can add), and either.

Prints the means over slots. Offline (no engine, no timing): the rates bound what a tree with one
sibling per slot can commit before any cost is paid.
"""
from __future__ import annotations

import argparse

import torch

from draftwise import LLM, SamplingParams
from draftwise.lab.workload import load_workload
from draftwise.model.loader import load_model
from draftwise.policies.profile import machine_info

FIRST_DRAWS = 64  # x1 over q's most probable tokens in the recursive-rejection expectation


def _without(q: torch.Tensor) -> torch.Tensor:
    return q / (1 - q).clamp(min=1e-12)  # q(x) / (1 - q(x)): a second draw's weight after x


def coverage(q: torch.Tensor) -> torch.Tensor:
    """P(x among two draws without replacement from q)."""
    w = _without(q)
    return (q + q * (w.sum() - w)).clamp(max=1.0)


def rrs_two(p: torch.Tensor, q: torch.Tensor) -> float:
    """Acceptance of recursive rejection sampling over two draws without replacement."""
    resid = (p - q).clamp(min=0)
    z = float(resid.sum())
    firsts = torch.topk(q, min(FIRST_DRAWS, q.numel())).indices.tolist()
    acc = mass = 0.0
    for x in firsts:
        a1 = min(1.0, float(p[x] / q[x]))
        second = 0.0
        if z > 0 and a1 < 1.0:
            q2 = q.clone()
            q2[x] = 0
            second = float(torch.minimum(resid / z, q2 / q2.sum()).sum())
        acc += float(q[x]) * (a1 + (1 - a1) * second)
        mass += float(q[x])
    return acc / mass


def select_two(p: torch.Tensor, q: torch.Tensor, key: torch.Tensor) -> float:
    """Acceptance when the draw with the higher key is kept, then verified against its marginal r."""
    order = torch.argsort(key)
    qs = q[order]
    w = _without(qs)
    below_q, below_w = torch.cumsum(qs, 0) - qs, torch.cumsum(w, 0) - w
    r = torch.empty_like(q)
    r[order] = qs * (below_q / (1 - qs).clamp(min=1e-12) + below_w)
    return float(torch.minimum(p, r).sum())


def cut_bound(p: torch.Tensor, q: torch.Tensor) -> float:
    """min over H = the top-m tokens by p / coverage of p(not H) + P(a draw in H)."""
    order = torch.argsort(p / coverage(q).clamp(min=1e-30), descending=True)
    ps, qs = p[order], q[order]

    def tail(v):  # sums over positions m.. (H^c = the tokens from m on), with m = V: 0
        t = torch.flip(torch.cumsum(torch.flip(v, [0]), 0), [0])
        return torch.cat([t, t.new_zeros(1)])

    qc, wc, bc = tail(qs), tail(_without(qs)), tail(qs * _without(qs))
    both_outside = qc * wc - bc
    return float((tail(ps) + 1 - both_outside).min())


def slot_rates(p: torch.Tensor, q: torch.Tensor) -> dict:
    top = torch.topk(q, 2).indices
    return {"one draw": float(torch.minimum(p, q).sum()),
            "two draws, recursive rejection": rrs_two(p, q),
            "two draws, select the higher p/q": select_two(p, q, p / q.clamp(min=1e-30)),
            "bound": cut_bound(p, q),
            "point mass, top-1": float(p[top[0]]),
            "point masses, top-2": float(p[top].sum())}


def greedy_rates(p_logits: torch.Tensor, q_logits: torch.Tensor) -> dict:
    """A greedy row's slot: the target keeps the argmax, so a sibling helps where q's runner-up is it."""
    want = int(p_logits.argmax())
    top = torch.topk(q_logits, 2).indices.tolist()
    return {"argmax of q is the target's": float(top[0] == want),
            "runner-up of q is the target's": float(top[1] == want),
            "either": float(want in top)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="target")
    ap.add_argument("--draft", default="draft")
    ap.add_argument("--workload", default="code-hard")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.temperature < 0:
        ap.exit(2, f"tree_headroom: --temperature must be >= 0 (0: greedy), not {args.temperature}\n")
    greedy = args.temperature == 0
    try:
        reqs = load_workload(args.workload).requests[: args.requests]
    except ValueError as e:
        ap.exit(2, f"tree_headroom: {e}\n")
    if any(r.messages for r in reqs):
        ap.exit(2, f"tree_headroom: {args.workload} holds chat requests; a completion workload is needed\n")
    target, draft = load_model(args.target), load_model(args.draft)
    llm = LLM(str(target.path))
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.tokens, ignore_eos=True, seed=args.seed)
    sums: dict[str, float] = {}
    n = 0
    for r in reqs:
        ids = target.tokenizer.encode(r.prompt).ids
        out = list(llm.generate([ids], sp)[0].token_ids)
        seq = torch.tensor([ids + out])
        with torch.no_grad():
            P, Q = target.model.logits(seq)[0].double(), draft.model.logits(seq)[0].double()
        if not greedy:
            P, Q = torch.softmax(P / args.temperature, -1), torch.softmax(Q / args.temperature, -1)
        for i in range(len(ids) - 1, len(ids) - 1 + len(out)):
            for k, v in (greedy_rates if greedy else slot_rates)(P[i], Q[i]).items():
                sums[k] = sums.get(k, 0.0) + v
            n += 1
    print(f"{machine_info()['cpu']}; {args.target} / {args.draft}, {args.workload}, "
          f"{len(reqs)} requests x {args.tokens} tokens, temperature {args.temperature}: {n} slots")
    for k, v in sums.items():
        print(f"  {k:34s} {v / n:.4f}")


if __name__ == "__main__":
    main()
