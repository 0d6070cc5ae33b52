"""Chat prompts made from the corpus's Python sources (layer 0: plain text, no model): a passage (a
function's source, a module docstring) with an ask drawn from it (`chat-grounded`), or an ask without
a passage (`chat-open`). The lab builds its chat workloads from the held-out files with these
(lab/make_workloads.py); `train draft --data self` builds its prompts from the training files.
"""
from __future__ import annotations

import ast

MAX_PASSAGE_CHARS = 1400  # the passage of a chat-grounded request


def parsed_sources(files: list[tuple[str, str]]):
    """(path, syntax tree, lines with their ends, dotted module stem) of every file that parses."""
    for rel, text in files:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        yield rel, tree, text.splitlines(keepends=True), rel.removesuffix(".py").replace("/", ".")


def functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
            yield node


# chat-grounded asks, over a function's source ({kind} = "function") or a docstring ("passage")
GROUNDED_ASKS = (
    "Rewrite this {kind} exactly, adding a short comment above each block of lines.",
    "Rewrite this function with type hints added, changing nothing else.",
    "Which lines of this {kind} decide what it returns? Quote them exactly, then explain them briefly.",
    "Summarise this {kind} in a few sentences, quoting its key phrases.",
)
DOC_ASKS = (
    "Summarise this passage from the documentation of {where}, quoting its key sentences.",
    "What does this passage from {where} say? Answer with its exact wording where you can.",
)
OPEN_ASKS = (
    "Write a Python function `{name}` that does the following: {summary}",
    "Explain what a Python function called `{name}` in the module `{module}` probably does, and how "
    "you would use it.",
    "What is the Python standard library module `{module}` for? Give an example of using it.",
)


def first_sentence(doc: str) -> str:
    text = " ".join(doc.strip().split("\n\n")[0].split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def chat_candidates(files: list[tuple[str, str]]) -> dict[str, list[tuple[str, str, dict]]]:
    """(id, kind, fields) candidates of the chat workloads, in path/line order; `chat_messages`
    turns a picked one into messages (the ask rotates with the request's index)."""
    grounded, open_ = [], []
    for rel, tree, lines, stem in parsed_sources(files):
        module = stem.removesuffix(".__init__")
        mod_doc = ast.get_docstring(tree)
        if mod_doc and len(mod_doc) >= 300:
            grounded.append((f"{stem}:doc", "doc", {"where": module, "passage": mod_doc[:MAX_PASSAGE_CHARS]}))
        for fn in functions(tree):
            start = (fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno) - 1
            src = "".join(lines[start : fn.end_lineno])
            fid = f"{stem}:{fn.lineno}:{fn.name}"
            if fn.end_lineno - start >= 8 and len(src) <= MAX_PASSAGE_CHARS and fn.col_offset == 0:
                grounded.append((fid, "function", {"passage": f"```python\n{src}```"}))
            summary = first_sentence(ast.get_docstring(fn) or "")
            if len(summary) >= 30 and summary[0].isupper() and "(" not in summary and not fn.name.startswith("_"):
                open_.append((fid, "open", {"name": fn.name, "module": module, "summary": summary}))
    return {"chat-grounded": grounded, "chat-open": open_}


def chat_messages(i: int, kind: str, fields: dict) -> tuple[tuple[str, str], ...]:
    """The messages of the i-th picked chat request."""
    if kind == "open":
        return (("user", OPEN_ASKS[i % len(OPEN_ASKS)].format(**fields)),)
    asks = DOC_ASKS if kind == "doc" else GROUNDED_ASKS
    ask = asks[i % len(asks)].format(kind="function", **fields)
    return (("user", f"{ask}\n\n{fields['passage']}"),)
