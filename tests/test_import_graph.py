"""The package's modules import one another in one direction: no module reaches itself through
imports.

Every `import` counts, at module level or inside a function (a lazy import is still a
dependency)."""

import ast
from pathlib import Path

root = Path(__file__).resolve().parent.parent
PKG = "hetero_infer"


def _modules() -> dict[str, Path]:
    return {p.stem: p for p in (root / PKG).glob("*.py") if p.stem != "_modidx"}


def import_graph() -> dict[str, set[str]]:
    "module -> the package modules it imports (`__init__` for the package itself)."
    mods, graph = _modules(), {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for a in node.names:
                    parts = a.name.split(".")
                    if parts[0] == PKG:
                        deps.add(parts[1] if len(parts) > 1 and parts[1] in mods else "__init__")
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level == 1:
                    base = f"{PKG}.{base}" if base else PKG
                elif node.level > 1:
                    continue
                parts = base.split(".")
                if parts[0] != PKG:
                    continue
                if len(parts) > 1:
                    deps.add(parts[1] if parts[1] in mods else "__init__")
                else:
                    deps |= {a.name if a.name in mods else "__init__" for a in node.names}
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    "The strongly connected components of more than one module (Tarjan)."
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, f"import cycles: {[sorted(c) for c in found]}"


def test_attention_backends_flow_one_way():
    """kernels imports attention (to subclass and register its backend); attention never imports
    kernels."""
    g = import_graph()
    assert "attention" in g["kernels"] and "kernels" not in g["attention"]


def test_cycle_finder():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert cycles({"a": {"b"}, "b": set()}) == []


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    "Every module `start` imports, directly or through others."
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_the_engine_imports_neither_speculation_nor_parallelism():
    """Chapters 12 and 13 plug into the step through plugins.py (issue 24): engine.py and
    llm_engine.py reach neither speculative nor parallel, even through other modules."""
    g = import_graph()
    for mod in ("engine", "llm_engine"):
        assert not reachable(g, mod) & {"speculative", "proposers", "parallel", "tp_shards"}, mod
    assert {"speculative", "parallel"} <= g["__init__"]  # the package registers both


def test_reachable():
    assert reachable({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, "a") == {"a", "b", "c"}
    assert reachable({"a": set()}, "a") == set()
