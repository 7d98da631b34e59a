"""The shape a reader relies on: parts in subpackages, a small core that names no later chapter,
a short step loop, and plugins that use only the engine's public parts."""

import inspect
import re
from pathlib import Path

root = Path(__file__).resolve().parent.parent
PKG = root / "hetero_infer"
CORE_CHAPTERS = ("00_", "01_", "02_", "03_", "05_", "06_", "07_")
CORE_BUDGET = 4500  # lines the core chapters may export
# what only later chapters know about
LATER_WORDS = re.compile(
    r"(?i)specul|structured|grammar|\btools?\b|tool.call|kv.tier|offload|swap|quantiz|expert"
)


def exporting_chapter(py: Path) -> str | None:
    "The notebook a module is exported from (nbdev's header), or None."
    m = re.search(r"File to edit: (?:\.\./)+nbs/(\w+)\.ipynb", py.read_text()[:600])
    return m[1] if m else None


def test_parts_are_subpackages():
    top = [p.name for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    top = [n for n in top if n != "_modidx.py"]
    subpackages = [p for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert len(top) <= 5, top
    assert len(subpackages) >= 8, subpackages


def test_the_engine_names_no_later_chapter():
    """The engine (chapter 07: the step loop, its output side, its plug-in protocol) says nothing
    of the features that plug into it. (A chat template may take `tools`: tokenization is HF's.)"""
    found = []
    for py in (PKG / "engine").glob("*.py"):
        if exporting_chapter(py) != "07_engine" or py.name in ("llm.py", "tokenization.py"):
            continue
        for i, line in enumerate(py.read_text().splitlines(), 1):
            found += [f"{py.name}:{i}: {m[0]!r}" for m in LATER_WORDS.finditer(line)]
    assert not found, "\n".join(found)


def test_the_step_is_a_short_loop():
    from hetero_infer.engine.llm_engine import LLMEngine

    lines = inspect.getsource(LLMEngine.step).splitlines()
    assert len(lines) <= 25, len(lines)


def test_nothing_outside_the_engine_touches_its_privates():
    "No `engine._x` (nor `eng._x`, `.engine._x`) anywhere in the package but the engine itself."
    pattern = re.compile(r"\b(?:engine|eng)\._[a-z]\w*")
    found = [
        f"{py.relative_to(root)}: {m[0]}"
        for py in PKG.rglob("*.py")
        if py.parent.name != "engine" and py.name != "_modidx.py"
        for m in pattern.finditer(py.read_text())
    ]
    assert not found, "\n".join(found)


def core_lines() -> dict[str, int]:
    "Lines of every module the core chapters export."
    return {
        str(py.relative_to(PKG)): len(py.read_text().splitlines())
        for py in PKG.rglob("*.py")
        if (exporting_chapter(py) or "").startswith(CORE_CHAPTERS)
    }


def test_the_core_stays_small():
    lines = core_lines()
    assert sum(lines.values()) <= CORE_BUDGET, sorted(lines.items(), key=lambda kv: -kv[1])


def test_the_checks_catch_what_they_should():
    assert LATER_WORDS.search("if self.speculator is not None")
    assert LATER_WORDS.search("self.kv_tier.apply(sched)")
    assert not LATER_WORDS.search("the scheduler picks what runs; the sampler picks a token")
