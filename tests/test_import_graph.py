"""The package's modules import one another in one direction: no module reaches itself through
imports.

Every `import` counts, at module level or inside a function (a lazy import is still a
dependency)."""

import ast
import json
import re
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


# ---- the book's order is the import order


def _chapter_of_modules() -> dict[str, str]:
    "module -> the notebook (chapter) that exports it, from nbdev's header in each module."
    out = {}
    for name, path in _modules().items():
        m = re.search(r"File to edit: (?:\.\./)+nbs/(\w+)\.ipynb", path.read_text()[:600])
        if m:
            out[name] = m[1]
    return out


def _notebook_imports(nb: Path, mods: dict) -> set[str]:
    "The package modules a notebook's code cells import."
    deps = set()
    for cell in json.loads(nb.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        for m in re.finditer(r"(?:from|import)\s+hetero_infer\.([\w.]+)", src):
            deps.add(_resolve(m[1], mods))
    return deps - {"__init__"}


def later_imports() -> list[str]:
    """Every import of a later chapter: by a module of an earlier chapter (at the top or inside
    a function), or by an earlier chapter's notebook. The package's `__init__` imports them all."""
    chap, mods, found = _chapter_of_modules(), _modules(), []
    for mod, deps in import_graph().items():
        if mod == "__init__" or mod not in chap:
            continue
        later = [d for d in deps if chap.get(d, "") > chap[mod]]
        found += [f"{mod} ({chap[mod]}) imports {d} ({chap[d]})" for d in later]
    for nb in sorted((root / "nbs").glob("[0-9]*.ipynb")):
        for d in _notebook_imports(nb, mods):
            if chap.get(d, "") > nb.stem:
                found.append(f"notebook {nb.stem} imports {d} ({chap[d]})")
    return found


def test_no_module_or_notebook_imports_a_later_chapter():
    found = later_imports()
    assert not found, "\n".join(found)


def test_no_unused_import_is_excused_outside_the_package_root():
    "`noqa: F401` (an import kept only to re-export it) appears in `__init__.py` alone."
    hits = [
        f"{name}: {line.strip()}"
        for name, path in _modules().items()
        for line in path.read_text().splitlines()
        if "noqa: F401" in line
    ]
    assert not hits, "\n".join(hits)


def only_reexports(src: str) -> bool:
    "Whether a module's code is nothing but imports (and `__all__`): a re-export shim."
    body = [n for n in ast.parse(src).body if not isinstance(n, ast.Expr)]  # docstrings
    assigns_all = lambda n: (
        isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
    )
    return bool(body) and all(
        isinstance(n, (ast.Import, ast.ImportFrom)) or assigns_all(n) for n in body
    )


def test_no_module_only_reexports():
    shims = [name for name, path in _modules().items() if only_reexports(path.read_text())]
    assert not shims, shims


def test_the_checks_catch_what_they_should():
    assert only_reexports('"""doc"""\nfrom .a import b\n__all__ = ["b"]\n')
    assert not only_reexports("from .a import b\n\n\ndef f():\n    return b\n")
    assert not only_reexports('"""only a docstring"""\n')
