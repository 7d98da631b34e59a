"""Render every notebook to HTML with nbconvert (no Quarto) and fail on any error.

Fails when a notebook does not convert, holds an error output, or is missing from the docs sidebar."""
import sys
from pathlib import Path
import nbformat
from nbconvert import HTMLExporter

root = Path(__file__).resolve().parent.parent
out = root / "_site_check"; out.mkdir(exist_ok=True)
problems = []
for p in sorted((root / "nbs").glob("*.ipynb")):
    try:
        nb = nbformat.read(p, as_version=4)
        nbformat.validate(nb)
        errs = [o.get("ename", "error") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
        if errs: problems.append(f"{p.name}: stored error output(s): {', '.join(errs)}")
        html, _ = HTMLExporter().from_notebook_node(nb)
        (out / (p.stem + ".html")).write_text(html)
        print(f"ok  {p.name} -> _site_check/{p.stem}.html ({len(html) // 1024} KB)")
    except Exception as e: problems.append(f"{p.name}: {type(e).__name__}: {e}")

sys.path.insert(0, str(root / "tests"))
from test_project import sidebar_problems
problems += sidebar_problems()
if problems: sys.exit("docs-check failed:\n  " + "\n  ".join(problems))
print("docs-check passed")
