"""Render every notebook to HTML with nbconvert (no Quarto) and fail on any error.

Fails when a notebook does not convert, holds an error output, refers in its markdown to an image
file that does not exist (relative to nbs/), or is missing from the docs sidebar. Images the
notebooks refer to are copied beside the HTML, so the rendered pages show them."""

import re
import shutil
import sys
from pathlib import Path
import nbformat
from nbconvert import HTMLExporter

root = Path(__file__).resolve().parent.parent
out = root / "_site_check"
out.mkdir(exist_ok=True)

# a markdown image or an HTML <img> with a local target (not a URL, data: or attachment:, nor an
# anchor)
_IMAGES = [
    re.compile(r"!\[[^\]]*\]\(\s*(?:<([^>]+)>|([^)\s]+))"),
    re.compile(r"""<img\b[^>]*?\bsrc=["']([^"']+)""", re.I),
]


def local_images(markdown: str) -> list[str]:
    "The local image paths a markdown cell refers to."
    found = [next(g for g in m.groups() if g) for pat in _IMAGES for m in pat.finditer(markdown)]
    return [p for p in found if not re.match(r"(?:[a-z][a-z0-9+.-]*:|#)", p, re.I)]


problems = []
for p in sorted((root / "nbs").glob("*.ipynb")):
    try:
        nb = nbformat.read(p, as_version=4)
        nbformat.validate(nb)
        errs = [
            o.get("ename", "error")
            for c in nb.cells
            if c.cell_type == "code"
            for o in c.get("outputs", [])
            if o.output_type == "error"
        ]
        if errs:
            problems.append(f"{p.name}: stored error output(s): {', '.join(errs)}")
        for img in sorted(
            {i for c in nb.cells if c.cell_type == "markdown" for i in local_images(c.source)}
        ):
            f = (p.parent / img.split("#")[0].split("?")[0]).resolve()
            if not f.is_file():
                problems.append(
                    f"{p.name}: markdown refers to image {img!r}, which does not exist under nbs/"
                )
                continue
            if (root / "nbs") not in f.parents:
                continue
            dst = out / f.relative_to(
                root / "nbs"
            )  # beside the HTML, so the rendered page shows it
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst)
        html, _ = HTMLExporter().from_notebook_node(nb)
        (out / (p.stem + ".html")).write_text(html)
        print(f"ok  {p.name} -> _site_check/{p.stem}.html ({len(html) // 1024} KB)")
    except Exception as e:
        problems.append(f"{p.name}: {type(e).__name__}: {e}")

sys.path.insert(0, str(root / "tests"))
from test_project import sidebar_problems  # noqa: E402

problems += sidebar_problems()
if problems:
    sys.exit("docs-check failed:\n  " + "\n  ".join(problems))
print("docs-check passed")
