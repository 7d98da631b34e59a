"""Write README.md from nbs/index.ipynb with nbconvert (Quarto, which nbdev_readme needs, is not
available).

`--check` fails when README.md is not what the notebook gives."""

import re
import sys
from pathlib import Path
import nbformat
from nbconvert import MarkdownExporter

root = Path(__file__).resolve().parent.parent


def _hidden(src: str) -> bool:
    return bool(re.search(r"^#\|\s*(hide|exporti?|exec_doc:\s*false)\b", src, re.M))


# a markdown image or an HTML <img> whose target is relative to nbs/ (not a URL, an absolute path,
# data: or an anchor)
_MD_IMAGE = re.compile(r"(!\[[^\]]*\]\()(?!(?:[a-z][a-z0-9+.-]*:|/|#))([^)\s]+)")
_HTML_IMAGE = re.compile(
    r"""(<img\b[^>]*?\bsrc=["'])(?!(?:[a-z][a-z0-9+.-]*:|/|#))([^"']+)""", re.I
)


def repo_relative_images(markdown: str, folder: str = "nbs") -> str:
    """Point image links relative to the notebook's folder at `folder/...`, so they resolve from the
    repository root (GitHub)."""
    fix = lambda m: m.group(1) + f"{folder}/" + m.group(2)
    return _HTML_IMAGE.sub(fix, _MD_IMAGE.sub(fix, markdown))


def render() -> str:
    nb = nbformat.read(root / "nbs" / "index.ipynb", as_version=4)
    cells = [c for c in nb.cells if not (c.cell_type == "code" and _hidden(c.source))]
    for c in cells:
        if c.cell_type == "code" and re.search(r"^#\|\s*echo:\s*false\b", c.source, re.M):
            shown = [o.get("data", {}).get("text/markdown", "") for o in c.get("outputs", [])]
            c.cell_type, c.source = "markdown", "\n".join(shown)  # its output only: a table
            c.pop("outputs", None)
            c.pop("execution_count", None)
        elif c.cell_type == "code":
            c.source = "\n".join(l for l in c.source.splitlines() if not l.startswith("#|")).strip()
        if c.cell_type == "markdown":
            c.source = repo_relative_images(c.source)  # engine_step.svg -> nbs/engine_step.svg
    nb.cells = [c for c in cells if c.source.strip()]  # a cell of directives only shows nothing
    nb.metadata["language_info"] = {"name": "python"}  # so code cells get ```python fences
    body, _ = MarkdownExporter(
        exclude_input_prompt=True, exclude_output_prompt=True
    ).from_notebook_node(nb)
    body = re.sub(r"\n{3,}", "\n\n", body).strip() + "\n"
    return (
        "<!-- Generated from nbs/index.ipynb by `make readme`: "
        "edit the notebook, not this file. -->\n\n" + body
    )


if __name__ == "__main__":
    text, readme = render(), root / "README.md"
    if "--check" in sys.argv:
        if not readme.exists() or readme.read_text() != text:
            sys.exit(
                "README.md is out of sync with nbs/index.ipynb: run `make readme` and commit it"
            )
        print("README.md is in sync with nbs/index.ipynb")
    else:
        readme.write_text(text)
        print("wrote README.md")
