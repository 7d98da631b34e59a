"""Stored notebook outputs are evidence on the docs site: they must not leak the paths of the
machine that ran them, nor show errors."""

import json
import re
from pathlib import Path
import pytest

root = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p for p in (root / "nbs").glob("*.ipynb"))

ABS_PATH = re.compile(r"(?<![\w.~-])/(?:work|home|tmp|root|Users|private/var|var/folders)/[\w.-]")
WIN_PATH = re.compile(r"\b[A-Z]:\\\\?(?:Users|Windows)\\")


def _texts(out: dict):
    """The text an output stores: stream text, tracebacks, and text/* or JSON data (images are
    skipped)."""
    if "text" in out:
        yield "".join(out["text"]) if isinstance(out["text"], list) else out["text"]
    if "traceback" in out:
        yield "\n".join(out["traceback"])
    for mime, v in out.get("data", {}).items():
        if mime.startswith("text/") or mime.endswith("json"):
            yield "".join(v) if isinstance(v, list) else v if isinstance(v, str) else json.dumps(v)


def output_problems(nb_path: Path) -> list[str]:
    """One line per stored error output or absolute path in `nb_path`'s outputs: 'notebook cell N:
    what'."""
    nb, probs = json.loads(nb_path.read_text()), []
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            where = f"{nb_path.name} cell {i}"
            if out.get("output_type") == "error":
                probs.append(
                    f"{where}: stored error {out.get('ename')}: {out.get('evalue', '')[:80]}"
                )
            if (
                out.get("output_type") == "stream"
                and out.get("name") == "stderr"
                and "Traceback (most recent call last)" in "".join(out.get("text", ""))
            ):
                probs.append(f"{where}: stored traceback on stderr")
            for t in _texts(out):
                for m in (ABS_PATH.search(t), WIN_PATH.search(t)):
                    if m:
                        probs.append(
                            f"{where}: stored absolute path "
                            f"{t[max(m.start() - 20, 0) : m.end() + 30]!r}"
                        )
    return probs


@pytest.mark.parametrize("nb", [p.name for p in NOTEBOOKS])
def test_no_stored_errors_or_absolute_paths(nb):
    assert output_problems(root / "nbs" / nb) == []


def test_the_checks_catch_what_they_should(tmp_path):
    cells = [
        {
            "cell_type": "code",
            "source": "",
            "metadata": {},
            "outputs": [
                {"output_type": "error", "ename": "ValueError", "evalue": "boom", "traceback": []},
                {
                    "output_type": "stream",
                    "name": "stderr",
                    "text": ["Traceback (most recent call last):\n", "  ...\n"],
                },
                {
                    "output_type": "execute_result",
                    "metadata": {},
                    "data": {"text/plain": ["PosixPath('/home/me/models/x')"]},
                },
                {"output_type": "stream", "name": "stdout", "text": "saved to /tmp/abc.json\n"},
                {
                    "output_type": "stream",
                    "name": "stdout",
                    "text": "see nbs/05_model.ipynb and hetero_infer/demo_model, 3/tmp\n",
                },
            ],
        }
    ]
    p = tmp_path / "x.ipynb"
    p.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    probs = output_problems(p)
    assert len(probs) == 4 and all(s.startswith("x.ipynb cell 0: ") for s in probs), probs
    assert [
        "stored error" in probs[0],
        "traceback" in probs[1],
        "/home/me" in probs[2],
        "/tmp/abc" in probs[3],
    ] == [True] * 4
