"""Evaluation on the held-out split: validation loss, speculative acceptance, ast parse rate."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.cpu_kernels import bf16_native
from .data import eval_windows


@torch.no_grad()
def val_loss(model, stream: torch.Tensor, seq_len: int = 512, max_windows: int | None = None,
             batch_size: int = 8, autocast: bool = True) -> float:
    """Mean next-token cross-entropy (nats/token) over non-overlapping held-out windows."""
    windows = eval_windows(stream, seq_len, max_windows)
    total, n = 0.0, 0
    dev = next(model.parameters()).device
    for i in range(0, len(windows), batch_size):
        b = windows[i:i + batch_size].to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast and (dev.type == "cuda" or bf16_native())):
            logits = model.logits(b[:, :-1])
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), b[:, 1:].reshape(-1),
                                       reduction="sum"))
        n += b[:, 1:].numel()
    return total / max(n, 1)


# -- held-out function-completion prompts ---------------------------------------------------------

def function_prompts(split, tok, n: int = 64, max_prompt_tokens: int = 256, max_body_tokens: int = 100) -> list[dict]:
    """`n` held-out functions (top-level or methods, dedented) with a docstring, evenly spaced in
    (path, line) order among those whose prompt (signature + docstring) is at most
    `max_prompt_tokens` and whose remaining body is at most `max_body_tokens` tokens, so that the
    reference completion fits in the 128-token budget. The prompt ends at the docstring's closing
    quotes, without the newline (see below); the completion starts with it."""
    import ast
    import textwrap

    cands = []
    for path, text in split.texts("held_out"):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
                continue
            doc = node.body[0]
            if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)) or len(node.body) < 2:
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            src = textwrap.dedent("".join(lines[start:node.end_lineno]))
            cut = doc.end_lineno - start
            src_lines = src.splitlines(keepends=True)
            prompt, body = "".join(src_lines[:cut]), "".join(src_lines[cut:])
            if not prompt.endswith("\n"):
                continue
            # End the prompt at the docstring's closing quotes: byte-level BPE merges a newline with
            # the next line's indentation, so a prompt ending in a bare newline token tells the
            # model that the next line is NOT indented (the body would never start).
            prompt = prompt.rstrip("\n")
            p_len, b_len = len(tok.encode(prompt).ids), len(tok.encode(body).ids)
            if p_len <= max_prompt_tokens and b_len <= max_body_tokens:
                cands.append({"path": path, "name": node.name, "line": node.lineno, "prompt": prompt,
                              "reference": body})
    cands.sort(key=lambda c: (c["path"], c["line"]))
    if len(cands) <= n:
        return cands
    return [cands[int(i * len(cands) / n)] for i in range(n)]


def cut_function(prompt: str, completion: str) -> str:
    """Prompt + completion up to the end of the function's indentation block (the first
    non-blank line at column 0 after the prompt ends the function)."""
    out = [prompt]
    for line in completion.splitlines(keepends=True):
        if line.strip() and not line[0].isspace():
            break
        out.append(line)
    return "".join(out)


def parses(code: str) -> bool:
    import ast

    try:
        ast.parse(code)
        return True
    except (SyntaxError, ValueError):
        return False


# -- generation (draftwise's own engine) ----------------------------------------------------------

def generate(model_dir, prompt_ids: list[list[int]], max_new_tokens: int = 128, temperature: float = 0.0,
             seed: int = 0, batch_size: int = 64) -> list[list[int]]:
    """Target completions with draftwise's engine (continuous batching, paged KV cache), EOS included.

    transformers is a test-only dependency; the training pipeline never needs it at run time."""
    from ..llm import LLM
    from ..sampling import SamplingParams

    llm = LLM(str(model_dir), max_num_seqs=batch_size)
    params = [SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed + i)
              for i in range(len(prompt_ids))]
    return [o.token_ids for o in llm.generate([list(p) for p in prompt_ids], params)]


def expected_rounds(beta: list[float], k: int = 4) -> tuple[float, float, float]:
    """Expected (rounds, committed, accepted) for speculative decoding with `k` draft tokens over
    positions whose acceptance probabilities are `beta` (beta[i]: the draft token for position i
    is accepted, given the prefix). A round starting at position t accepts a tokens with
    probability prod(beta[t:t+a]) * (1 - beta[t+a]) and commits a + 1 (the target's correction or
    bonus token); at temperature 0, beta is 0/1 and this is the exact simulation."""
    n = len(beta)
    p_start = [0.0] * (n + 1)
    p_start[0] = 1.0
    rounds = committed = accepted = 0.0
    for t in range(n):
        w = p_start[t]
        if w == 0.0:
            continue
        rounds += w
        amax = min(k, n - t - 1)
        run = 1.0
        for a in range(amax + 1):
            pa = run * ((1.0 - beta[t + a]) if a < amax else 1.0)
            p_start[t + a + 1] += w * pa
            committed += w * pa * (a + 1)
            accepted += w * pa * a
            run *= beta[t + a] if a < amax else 1.0
    return rounds, committed, accepted


@torch.no_grad()
def acceptance_betas(target, draft, seqs: list[tuple[int, list[int]]], temperature: float) -> list[list[float]]:
    """Per generated position: the probability that the draft's token is accepted by the target.
    Temperature 0: 1.0 if argmax draft == argmax target else 0.0. Temperature T > 0: the
    speculative-sampling acceptance sum_x min(p(x), q(x)) of the tempered distributions."""
    out = []
    for prompt_len, ids in seqs:
        x = torch.tensor([ids[:-1]])
        lp = target.logits(x)[0, prompt_len - 1:].float()
        lq = draft.logits(x)[0, prompt_len - 1:].float()
        if temperature == 0:
            b = (lp.argmax(-1) == lq.argmax(-1)).float()
        else:
            b = torch.minimum(torch.softmax(lp / temperature, -1), torch.softmax(lq / temperature, -1)).sum(-1)
        out.append(b.tolist())
    return out


def acceptance_summary(betas: list[list[float]], k: int = 4) -> dict:
    R = C = A = 0.0
    for b in betas:
        r, c, a = expected_rounds(b, k)
        R, C, A = R + r, C + c, A + a
    return {"k": k, "rounds": round(R, 1), "mean_accepted_length": round(C / max(R, 1e-9), 3),
            "acceptance_rate": round(A / max(R * k, 1e-9), 3),
            "per_token_acceptance": round(sum(map(sum, betas)) / max(1, sum(map(len, betas))), 3)}
