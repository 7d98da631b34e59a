"""The package's modules import one another in one direction: no module reaches itself through
imports.

Every `import` counts, at module level or inside a function (a lazy import is still a
dependency)."""

import ast
from pathlib import Path

root = Path(__file__).resolve().parent.parent
PKG = "hetero_infer"


def _modules() -> dict[str, Path]:
    "Dotted module name (relative to the package) -> file, `__init__` files excluded."
    pkg = root / PKG
    return {
        ".".join(p.relative_to(pkg).with_suffix("").parts): p
        for p in pkg.rglob("*.py")
        if p.stem not in ("_modidx", "__init__")
    }


def _resolve(name: str, mods: dict) -> str:
    "The package module a dotted import names (the longest prefix that is a module)."
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in mods:
            return ".".join(parts[:k])
    return "__init__"


def import_graph() -> dict[str, set[str]]:
    "module -> the package modules it imports (`__init__` for a package's own `__init__`)."
    mods, graph = _modules(), {}
    mods_init = {**mods, "__init__": root / PKG / "__init__.py"}
    for name, path in mods_init.items():
        here = name.split(".")[:-1]  # the package holding this module
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == PKG:
                        deps.add(_resolve(a.name.partition(".")[2], mods))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    if name == "__init__":
                        base = node.module or ""
                    else:
                        pkg = here[: len(here) - node.level + 1]
                        base = ".".join([*pkg, node.module] if node.module else pkg)
                elif (node.module or "").split(".")[0] == PKG:
                    base = node.module.partition(".")[2]
                else:
                    continue
                for a in node.names:
                    full = f"{base}.{a.name}" if base else a.name
                    deps.add(_resolve(full if full in mods else base, mods))
        graph[name] = deps - {name, "__init__"} if name != "__init__" else deps - {name}
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
    triton, torch_backend = "attention.triton.backend", "attention.backend"
    assert torch_backend in g[triton] and triton not in g[torch_backend]


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
    later = {
        "spec_decode.speculator",
        "spec_decode.proposers",
        "parallel.runner",
        "parallel.shards",
    }
    for mod in ("engine.llm", "engine.llm_engine"):
        assert not reachable(g, mod) & later, mod
    assert {"spec_decode.speculator", "parallel.runner"} <= g[
        "__init__"
    ]  # the package registers both


def test_reachable():
    assert reachable({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, "a") == {"a", "b", "c"}
    assert reachable({"a": set()}, "a") == set()
