"""Build the shipped workloads from the held-out split of the training corpus (stdlib sources).

    python -m draftwise.lab.make_workloads [--out DIR] [--n 24]

- `code-easy`: the file's text just before a short function, its header and first body line;
  the continuation is ordinary code (greedy).
- `code-hard`: prompts that end where a docstring or a comment starts: prose, where a small
  drafter and the target disagree (sampled at temperature 1).
- `grounded`: a function shown in full, then asked for again unchanged ("refactor" edits that
  keep most lines): the continuation repeats prompt text, where n-gram lookup shines (greedy).
- `shared-prefix`: the code-easy requests behind one long shared preamble (the first lines of a
  held-out file, like a system prompt or a shared document): what prefix caching saves (greedy).
- `json`: a function shown in full, then asked for as JSON matching `FUNCTION_SCHEMA` (structured
  output: name, arguments, returns a value, has a docstring; greedy).
- `chat-grounded`: chat requests (`messages`, rendered with the model's chat template) that give
  a passage, a function's source or its docstring, and ask for an answer drawn from it (rewrite
  it with comments or type hints, quote the lines that do X, summarise it): replies copy much of
  the passage, where n-gram lookup shines (greedy, 128 tokens).
- `chat-open`: chat requests without a passage: write a function from a docstring's first
  sentence, explain what a held-out function or module is for (greedy, 128 tokens).
- `file-edit`, `json-edit`: multi-turn chat edits that re-emit a file excerpt or a JSON record
  the conversation shows (lab/edit_workloads.py): repetitive replies, where suffix decoding
  shines (greedy).

Deterministic: candidates are collected in path/line order and picked evenly spaced. Prompts
stay short (a few hundred tokens) so that prompt + max_tokens fits a 1024-token context.
"""
from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

from ..chat_prompts import chat_candidates, chat_messages, functions as _functions
from ..chat_prompts import parsed_sources as _parsed
from ..corpus import split
from .edit_workloads import file_edit_candidates, json_edit_candidates
from .workload import WORKLOADS_DIR, Request, write_jsonl

MAX_CONTEXT_CHARS = 900  # preceding file text kept before the function
MAX_GROUNDED_CHARS = 1100  # the function shown in a grounded prompt
CHAT_MAX_TOKENS = 128
SHARED_PREFIX_CHARS = 1800  # the preamble every shared-prefix request starts with
FUNCTION_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "arguments": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 8},
        "returns_value": {"type": "boolean"},
        "has_docstring": {"type": "boolean"},
    },
    "required": ["name", "arguments", "returns_value", "has_docstring"],
    "additionalProperties": False,
}


def _context(lines: list[str], upto: int, max_chars: int) -> str:
    """Whole lines before line index `upto`, at most max_chars."""
    out, n = [], 0
    for line in reversed(lines[:upto]):
        if n + len(line) > max_chars:
            break
        out.append(line)
        n += len(line)
    return "".join(reversed(out))


def _docstring_node(fn) -> ast.Constant | None:
    if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
            and isinstance(fn.body[0].value.value, str):
        return fn.body[0].value
    return None


def candidates(files: list[tuple[str, str]]) -> dict[str, list[tuple[str, str, int, float]]]:
    """(id, prompt, max_tokens, temperature) candidates per workload, in path/line order."""
    easy, hard, grounded, as_json = [], [], [], []
    for rel, tree, lines, stem in _parsed(files):
        for fn in _functions(tree):
            start = (fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno) - 1
            end = fn.end_lineno
            body = fn.body[1:] if _docstring_node(fn) else fn.body
            n_lines = end - start
            fid = f"{stem}:{fn.lineno}:{fn.name}"
            # code-easy: short functions without a docstring, prompt ends after the first body line
            if not _docstring_node(fn) and 4 <= n_lines <= 25 and body:
                first = body[0].lineno - 1
                prompt = _context(lines, start, MAX_CONTEXT_CHARS) + "".join(lines[start : first + 1])
                easy.append((fid, prompt, 64, 0.0))
            # code-hard: prompt ends at the opening quotes of a docstring
            doc = _docstring_node(fn)
            if doc is not None and doc.end_lineno - doc.lineno >= 2:
                head = "".join(lines[start : doc.lineno - 1])
                quote_line = lines[doc.lineno - 1]
                q = quote_line.find('"""') if '"""' in quote_line else quote_line.find("'''")
                if q >= 0:
                    prompt = _context(lines, start, MAX_CONTEXT_CHARS) + head + quote_line[: q + 3]
                    hard.append((fid, prompt, 64, 1.0))
            # grounded: the whole function, then the same function asked for again
            src = "".join(lines[start:end])
            if 8 <= n_lines and len(src) <= MAX_GROUNDED_CHARS and fn.col_offset == 0:
                header = lines[fn.lineno - 1]
                prompt = (f"# {rel}\n{src}\n\n# The same function, reformatted only "
                          f"(identical behaviour and names):\n{header}")
                grounded.append((fid, prompt, 128, 0.0))
                as_json.append((fid, f"# {rel}\n{src}\n\n# The function above as JSON (name, arguments, whether it "
                                     "returns a value, whether it has a docstring):\n", 96, 0.0))
        # code-hard, second kind: block comments inside code
        for i, line in enumerate(lines):
            s = line.lstrip()
            if s.startswith("# ") and len(s) > 40 and i > 5 and not lines[i - 1].lstrip().startswith("#"):
                prompt = _context(lines, i, MAX_CONTEXT_CHARS) + line[: len(line) - len(s)] + "# "
                hard.append((f"{stem}:{i + 1}:comment", prompt, 64, 1.0))
    return {"code-easy": easy, "code-hard": hard, "grounded": grounded, "json": as_json}


def pick(items: list, n: int) -> list:
    if len(items) <= n:
        return list(items)
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def shared_prefix(files: list[tuple[str, str]], easy: list[tuple[str, str, int, float]]) -> list[tuple]:
    """The code-easy candidates behind one preamble: whole first lines of the first held-out file
    (in path order) longer than twice the preamble."""
    rel, text = next((r, t) for r, t in files if len(t) > 2 * SHARED_PREFIX_CHARS)
    lines = text.splitlines(keepends=True)
    preamble, n = "", 0
    for line in lines:
        if n + len(line) > SHARED_PREFIX_CHARS:
            break
        preamble += line
        n += len(line)
    head = f"# {rel}\n{preamble}\n\n"
    return [(fid, head + prompt, 32, 0.0) for fid, prompt, _, _ in easy]


def build(out: Path = WORKLOADS_DIR, n: int = 24, only: set[str] | None = None) -> dict[str, int]:
    files = split().texts("held_out")
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    cands = candidates(files)
    cands["shared-prefix"] = shared_prefix(files, pick(cands["code-easy"], n))
    chats = chat_candidates(files)
    edits = {"file-edit": file_edit_candidates(files), "json-edit": json_edit_candidates(files)}
    for name, groups in edits.items():  # whole groups of turns, in order
        if not only or name in only:
            turns = [t for group in pick(groups, max(1, n // 3)) for t in group]
            write_jsonl(out / f"{name}.jsonl", [Request(f"{name}-{i:02d}:{fid}", "", mt, 0.0, name, messages=msgs)
                                                for i, (fid, msgs, mt) in enumerate(turns)])
            counts[name] = len(turns)
    for name, items in {**cands, **chats}.items():
        if only and name not in only:
            continue
        chosen = pick(items, n)
        constraint = {"json_schema": json.dumps(FUNCTION_SCHEMA)} if name == "json" else None
        if name in chats:
            reqs = [Request(f"{name}-{i:02d}:{fid}", "", CHAT_MAX_TOKENS, 0.0, name,
                            messages=chat_messages(i, kind, fields))
                    for i, (fid, kind, fields) in enumerate(chosen)]
        else:
            reqs = [Request(f"{name}-{i:02d}:{fid}", prompt, mt, temp, name, constraint)
                    for i, (fid, prompt, mt, temp) in enumerate(chosen)]
        write_jsonl(out / f"{name}.jsonl", reqs)
        counts[name] = len(reqs)
    return counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=WORKLOADS_DIR)
    ap.add_argument("--n", type=int, default=24, help="requests per workload")
    ap.add_argument("--only", default=None, help="comma-separated workload names to write (default: all)")
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    for name, c in build(args.out, args.n, only).items():
        print(f"{args.out / name}.jsonl: {c} requests")


if __name__ == "__main__":
    main()
