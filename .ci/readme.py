"""Write README.md from nbs/index.ipynb with nbconvert (Quarto, which nbdev_readme needs, is not available).

`--check` fails when README.md is not what the notebook gives."""
import re, sys
from pathlib import Path
import nbformat
from nbconvert import MarkdownExporter

root = Path(__file__).resolve().parent.parent

def _hidden(src: str) -> bool: return bool(re.search(r"^#\|\s*(hide|exporti?|exec_doc:\s*false)\b", src, re.M))

def render() -> str:
    nb = nbformat.read(root / "nbs" / "index.ipynb", as_version=4)
    cells = [c for c in nb.cells if not (c.cell_type == "code" and _hidden(c.source))]
    for c in cells:
        if c.cell_type == "code": c.source = "\n".join(l for l in c.source.splitlines() if not l.startswith("#|")).strip()
    nb.cells = [c for c in cells if c.source.strip()]   # a cell of directives only leaves nothing to show
    nb.metadata["language_info"] = {"name": "python"}   # so code cells get ```python fences
    body, _ = MarkdownExporter(exclude_input_prompt=True, exclude_output_prompt=True).from_notebook_node(nb)
    body = re.sub(r"\n{3,}", "\n\n", body).strip() + "\n"
    return "<!-- Generated from nbs/index.ipynb by `make readme`: edit the notebook, not this file. -->\n\n" + body

if __name__ == "__main__":
    text, readme = render(), root / "README.md"
    if "--check" in sys.argv:
        if not readme.exists() or readme.read_text() != text:
            sys.exit("README.md is out of sync with nbs/index.ipynb: run `make readme` and commit it")
        print("README.md is in sync with nbs/index.ipynb")
    else:
        readme.write_text(text); print("wrote README.md")
