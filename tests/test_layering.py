"""Imports run one way (STYLE.md, principle 10): the layers of docs/ARCHITECTURE.md, from the source.

Every module under src/draftwise is parsed with `ast`; every import counts, those inside
functions too (a deferred import is still a dependency, and still closes a circle). Layers,
bottom to top:

    0  model/, kv/, sampling/, and the package-root leaves paths.py, corpus.py, chat_prompts.py
    1  proposers/, policies/
    2  engine/
    3  llm.py, server/, lab/, train/   (side by side: none imports another, see ALLOWED)
    4  cli/, demo.py, __main__.py, draftwise/__init__.py (the public facade)

A module may import its own layer and the ones below; a lower layer that needs something from a
higher one gets it passed in. No import circle among modules.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "draftwise"

LAYERS = {
    "model": 0, "kv": 0, "sampling": 0, "paths": 0, "corpus": 0, "chat_prompts": 0, "registry": 0,
    "proposers": 1, "policies": 1,
    "engine": 2,
    "llm": 3, "server": 3, "lab": 3, "train": 3,
    "cli": 4, "demo": 4, "__main__": 4, "": 4,  # "": the package's own __init__
}
LAYER_NAMES = ["model/kv/sampling", "proposers/policies", "engine", "llm/server/lab/train", "cli"]

# Imports between different groups of layer 3 that are allowed, with the reason.
ALLOWED = {
    # train evaluates the pair it trained (acceptance, generated samples for the model card)
    # through the offline API, the same way a user would; llm imports nothing of train.
    ("train", "llm"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The draftwise modules that `name` imports, anywhere in its body."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()

    def add(target: str) -> None:
        while target and target not in known:  # `import a.b.Name`-style paths: the longest module
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = from_base(package, node)
            if base.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:  # `from . import corpus` names a submodule, not an attribute
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base)
    return out


def from_base(package: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from X import ...` reads from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def missing_imports(name: str, path: Path, known: set[str]) -> list[str]:
    """draftwise modules that `name` imports but that do not exist (a module moved, an import
    inside a function left behind: most tests never run it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    bad = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.split(".")[0] == PACKAGE and a.name not in known]
        elif isinstance(node, ast.ImportFrom):
            base = from_base(package, node)
            if base.split(".")[0] == PACKAGE and base not in known:
                bad.append(base)
    return bad


def group(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = all_modules()
    known = set(mods)
    return {name: imported_modules(name, path, known) for name, path in mods.items()}


def test_every_module_has_a_layer(graph):
    missing = sorted(name for name in graph if group(name) not in LAYERS)
    assert not missing, f"place these modules in a layer (tests/test_layering.py LAYERS): {missing}"


def test_every_import_names_an_existing_module():
    mods = all_modules()
    bad = [f"{name} imports {m}" for name, path in mods.items() for m in missing_imports(name, path, set(mods))]
    assert not bad, "imports of modules that do not exist:\n" + "\n".join(bad)


def test_the_parser_sees_relative_deferred_and_absolute_imports(tmp_path):
    """The graph's own reader, on a made-up package: a test that cannot see imports passes."""
    pkg = tmp_path / PACKAGE / "lab"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text(
        "from . import y\nfrom ..engine.sequence import Sequence\n"
        "def f():\n    import draftwise.train.corpus\n    from ..kv import KVManager\n")
    known = {"draftwise.lab", "draftwise.lab.x", "draftwise.lab.y", "draftwise.engine", "draftwise.engine.sequence",
             "draftwise.train", "draftwise.train.corpus", "draftwise.kv"}
    assert imported_modules("draftwise.lab.x", pkg / "x.py", known) == {
        "draftwise.lab.y", "draftwise.engine.sequence", "draftwise.train.corpus", "draftwise.kv"}
    assert missing_imports("draftwise.lab.x", pkg / "x.py", known) == []
    (pkg / "x.py").write_text("def f():\n    from ..engine.runner import ModelRunner\n    import draftwise.nope\n")
    assert missing_imports("draftwise.lab.x", pkg / "x.py", known) == ["draftwise.engine.runner", "draftwise.nope"]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for name, targets in sorted(graph.items()):
        src = group(name)
        for t in sorted(targets):
            dst = group(t)
            if src not in LAYERS or dst not in LAYERS:
                continue  # reported by test_every_module_has_a_layer
            if LAYERS[dst] > LAYERS[src]:
                bad.append(f"{name} ({LAYER_NAMES[LAYERS[src]]}) imports {t} ({LAYER_NAMES[LAYERS[dst]]})")
    return bad


def test_upward_imports_are_reported():
    g = {"draftwise.proposers.base": {"draftwise.engine.sequence", "draftwise.kv"},
         "draftwise.engine.engine": {"draftwise.proposers", "draftwise.llm"}, "draftwise.cli.main": {"draftwise.llm"}}
    assert upward_imports(g) == [
        "draftwise.engine.engine (engine) imports draftwise.llm (llm/server/lab/train)",
        "draftwise.proposers.base (proposers/policies) imports draftwise.engine.sequence (engine)"]


def test_no_upward_imports(graph):
    bad = upward_imports(graph)
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_imports_across_the_application_layer(graph):
    bad, used = [], set()
    for name, targets in sorted(graph.items()):
        src = group(name)
        for t in sorted(targets):
            dst = group(t)
            if src != dst and LAYERS.get(src) == LAYERS.get(dst) == 3:
                if (src, dst) in ALLOWED:
                    used.add((src, dst))
                else:
                    bad.append(f"{name} imports {t}")
    assert not bad, "llm, server, lab and train do not import each other:\n" + "\n".join(bad)
    assert used == ALLOWED, f"exceptions no longer needed (remove them from ALLOWED): {ALLOWED - used}"


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    return cycles


def cycle_path(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One circle inside a strongly connected component, as a readable path a -> b -> ... -> a."""
    members = set(comp)
    start = comp[0]
    prev = {start: None}
    queue = [start]
    while queue:  # breadth-first from start back to start, inside the component
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return comp


def test_find_cycles_reports_a_circle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(g) == [["a", "b", "c"]]
    assert cycle_path(g, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles(graph):
    cycles = [" -> ".join(cycle_path(graph, comp)) for comp in find_cycles(graph)]
    assert not cycles, "import circles:\n" + "\n".join(cycles)
