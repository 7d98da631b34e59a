"""The course's shape, checked from the notebooks' cells: every chapter opens with what you will
learn and closes with a recap, and every exported function or class has a test or example right
under it (the nbdev rhythm)."""

import json
import re
from pathlib import Path
import pytest

root = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(p.name for p in (root / "nbs").glob("[0-9]*.ipynb"))


def _cells(nb: str) -> list[dict]:
    return [
        dict(c, source="".join(c["source"]))
        for c in json.loads((root / "nbs" / nb).read_text())["cells"]
    ]


def _directive(src: str, name: str) -> bool:
    return bool(re.search(rf"^#\|\s*{name}\b", src, re.M))


def opening_and_closing(nb: str) -> list[str]:
    """Problems with a chapter's first lines (it says what you will learn) and its last cell (a
    recap)."""
    md, probs = [c["source"] for c in _cells(nb) if c["cell_type"] == "markdown"], []
    title = next((i for i, s in enumerate(md) if re.match(r"#\s", s)), None)
    if title is None:
        return [f"{nb}: no `# Title` cell"]
    if not any(re.search(r"(?i)you will learn|will learn", s) for s in md[title : title + 3]):
        probs.append(f"{nb}: the cells after the title do not say what you will learn")
    last = _cells(nb)[-1]
    if not (last["cell_type"] == "markdown" and re.search(r"(?im)^#+\s*recap", last["source"])):
        probs.append(f"{nb}: the last cell is not a recap")
    return probs


def untested_exports(nb: str) -> list[str]:
    """Exported cells defining something that the next code cell does not test or show (it is
    another export cell, or none)."""
    code = [c["source"] for c in _cells(nb) if c["cell_type"] == "code"]
    probs = []
    for i, src in enumerate(code):
        if not (_directive(src, "export") or _directive(src, "exporti")):
            continue
        names = re.findall(r"^(?:async\s+)?(?:def|class)\s+(\w+)", src, re.M)
        if not names:
            continue
        nxt = code[i + 1] if i + 1 < len(code) else ""
        if not nxt or _directive(nxt, "export") or _directive(nxt, "exporti"):
            probs.append(
                f"{nb}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} has no test or "
                "example under it"
            )
    return probs


@pytest.mark.parametrize("nb", CHAPTERS)
def test_chapter_opens_and_closes(nb):
    assert opening_and_closing(nb) == []


@pytest.mark.parametrize("nb", CHAPTERS)
def test_every_export_has_a_test_under_it(nb):
    assert untested_exports(nb) == []


# ---- what a reader can follow: short cells, and the engine explained rather than its making

MAX_CELL_LINES = 100
# words that tell the story of the work instead of explaining the engine
HISTORY = re.compile(
    r"(?i)\bissue\s*#?\d+|\bthis session\b|\bphase\s+\d\b|\bolder imports?\b|old import paths?"
)


def long_cells(nb: str) -> list[str]:
    "Code cells over MAX_CELL_LINES lines."
    code = [c["source"] for c in _cells(nb) if c["cell_type"] == "code"]
    return [
        f"{nb}: code cell {i} has {n} lines"
        for i, src in enumerate(code)
        if (n := len(src.splitlines())) > MAX_CELL_LINES
    ]


def history_words(text: str, where: str) -> list[str]:
    "Each phrase of `text` that tells the project's history, with where it is."
    return [f"{where}: {m[0]!r}" for m in HISTORY.finditer(text)]


@pytest.mark.parametrize("nb", CHAPTERS)
def test_no_code_cell_is_longer_than_a_screen(nb):
    assert long_cells(nb) == []


def test_the_book_explains_the_engine_not_its_making():
    "No issue numbers, sessions, phases or old import paths in the notebooks, library or README."
    found = []
    for nb in sorted((root / "nbs").glob("*.ipynb")):
        found += history_words("\n".join(c["source"] for c in _cells(nb.name)), nb.name)
    for py in sorted((root / "hetero_infer").rglob("*.py")):
        found += history_words(py.read_text(), str(py.relative_to(root)))
    found += history_words((root / "README.md").read_text(), "README.md")
    assert found == [], "\n".join(found)


def test_the_checks_catch_what_they_should():
    assert history_words("fixed in issue 23; this session; phase 2", "x") == [
        "x: 'issue 23'",
        "x: 'this session'",
        "x: 'phase 2'",
    ]
    assert history_words("the scheduler issues 3 tokens in phase with the step", "x") == []
