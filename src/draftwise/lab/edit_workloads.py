"""The repetitive workloads: chat requests that re-emit text the conversation shows, with one small
change, as an agent editing a file or re-emitting a JSON record does (where suffix decoding pays).

- `file-edit`: a run of consecutive functions (or methods) of a held-out file, edited over three
  turns, one request each, in order: rename a function, add a docstring to another, reply with the
  whole file again. Turn t's messages are the turns before it, each answered by the assistant
  with the whole file as edited (the edits applied here, not a model's replies), then its own ask.
- `json-edit`: a JSON record of a held-out module's first functions (name, line, arguments,
  whether it returns a value, whether it has a docstring), over three turns the same way: one flag
  flipped, one field added, the whole record again.

A reply repeats text of its own conversation and the replies of the turns before it (earlier
requests). Greedy; max_tokens about the edited text's length in tokens (EDIT_MAX_TOKENS at most);
the third turn of the longest excerpt stays within a 1024-token context for the embedded models.
"""
from __future__ import annotations

import ast
import json
import re

from ..chat_prompts import parsed_sources

MIN_EXCERPT_CHARS, MAX_EXCERPT_CHARS = 300, 700
EDIT_MAX_TOKENS = 256
FUNCTIONS_PER_RECORD = 3


def _max_tokens(text: str) -> int:
    return min(EDIT_MAX_TOKENS, len(text) // 3 + 16)  # ~3-4.5 characters a token in code


Turn = tuple[str, tuple[tuple[str, str], ...], int]  # (id suffix, messages, max_tokens)


def _turns(title: str, lang: str, versions: list[str], asks: list[str], ids: list[str]) -> list[Turn]:
    """versions[0] shown with asks[0]; turn t answered by versions[t + 1]."""
    fence = lambda text: f"```{lang}\n{text}```"  # noqa: E731
    msgs = [("user", f"Here is {title}:\n{fence(versions[0])}\n{asks[0]}")]
    out = []
    for t, ask in enumerate(asks):
        if t:
            msgs += [("assistant", fence(versions[t])), ("user", ask)]
        out.append((ids[t], tuple(msgs), _max_tokens(fence(versions[t + 1]))))
    return out


def _runs(tree: ast.Module) -> list[list[ast.FunctionDef]]:
    """Runs of two or more consecutive functions: at the top level or a class's methods."""
    runs = []
    bodies = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
    for body in bodies:
        cur = []
        for node in body + [None]:
            if isinstance(node, ast.FunctionDef):
                cur.append(node)
                continue
            if len(cur) >= 2:
                runs.append(cur)
            cur = []
    return runs


def _excerpt(lines: list[str], fns: list[ast.FunctionDef]) -> tuple[str, list[ast.FunctionDef]] | None:
    """The longest prefix of the run (two functions at least) that fits, and its functions."""
    for end in range(len(fns), 1, -1):
        part = fns[:end]
        start = (part[0].decorator_list[0].lineno if part[0].decorator_list else part[0].lineno) - 1
        text = "".join(lines[start : part[-1].end_lineno])
        if MIN_EXCERPT_CHARS <= len(text) <= MAX_EXCERPT_CHARS:
            return text, part
    return None


def _add_docstring(text: str, fn: ast.FunctionDef, offset: int) -> str:
    """`text` with a one-line docstring above fn's first statement (fn's lines shifted by -offset)."""
    lines = text.splitlines(keepends=True)
    at = fn.body[0].lineno - 1 - offset
    indent = re.match(r"\s*", lines[at]).group(0)
    doc = f'{indent}"""{fn.name.strip("_").replace("_", " ").capitalize()}."""\n'
    return "".join(lines[:at] + [doc] + lines[at:])


def file_edit_candidates(files: list[tuple[str, str]]) -> list[list[Turn]]:
    """Per excerpt, its three turns, in path/line order."""
    out = []
    for rel, tree, lines, stem in parsed_sources(files):
        for run in _runs(tree):
            found = _excerpt(lines, run)
            if found is None:
                continue
            text, fns = found
            named = [f for f in fns if not (f.name.startswith("__") and f.name.endswith("__"))]
            bare = [f for f in fns if ast.get_docstring(f) is None and f.body[0].lineno > f.lineno
                    and named and f is not named[0]]
            if not bare:
                continue
            old, doc_fn = named[0].name, bare[0]
            new = f"{old.rstrip('_')}_v2"
            offset = (fns[0].decorator_list[0].lineno if fns[0].decorator_list else fns[0].lineno) - 1
            renamed = re.sub(rf"\b{re.escape(old)}\b", new, text)
            documented = _add_docstring(renamed, doc_fn, offset)
            fid = f"{stem}:{fns[0].lineno}"
            out.append(_turns(rel, "python", [text, renamed, documented, documented],
                              [f"Rename `{old}` to `{new}`. Reply with the whole file.",
                               f"Add a docstring to `{doc_fn.name}`. Reply with the whole file.",
                               "Reply with the whole file again, unchanged."],
                              [f"{fid}:rename", f"{fid}:docstring", f"{fid}:whole"]))
    return out


def _returns_value(fn: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(fn))


def json_edit_candidates(files: list[tuple[str, str]]) -> list[list[Turn]]:
    """Per module with enough top-level functions, its three turns, in path order."""
    out = []
    for rel, tree, lines, stem in parsed_sources(files):
        fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)][:FUNCTIONS_PER_RECORD]
        if len(fns) < FUNCTIONS_PER_RECORD:
            continue
        record = {"module": stem, "functions": [
            {"name": f.name, "line": f.lineno, "arguments": [a.arg for a in f.args.args],
             "returns_value": _returns_value(f), "has_docstring": ast.get_docstring(f) is not None}
            for f in fns]}
        text = json.dumps(record, indent=2) + "\n"
        if len(text) > MAX_EXCERPT_CHARS:
            continue
        flipped = json.loads(text)
        flipped["functions"][1]["has_docstring"] = not flipped["functions"][1]["has_docstring"]
        flipped_text = json.dumps(flipped, indent=2) + "\n"
        reviewed = {**flipped, "reviewed": True}
        reviewed_text = json.dumps(reviewed, indent=2) + "\n"
        flag = json.dumps(flipped["functions"][1]["has_docstring"])
        out.append(_turns(f"{stem}.json", "json", [text, flipped_text, reviewed_text, reviewed_text],
                          [f'Set "has_docstring" of `{fns[1].name}` to {flag}. Reply with the whole record.',
                           'Add "reviewed": true at the end. Reply with the whole record.',
                           "Reply with the whole record again, unchanged."],
                          [f"{stem}:flag", f"{stem}:field", f"{stem}:whole"]))
    return out
