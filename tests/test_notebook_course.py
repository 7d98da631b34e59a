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
