"""Run notebooks' `cuda` cells on a GPU machine and store their outputs back on any machine.

On the GPU machine (no TRITON_INTERPRET; run from nbs/):

    python ../.ci/gpu_cells.py run 04_paged_attention_triton.ipynb OUTDIR [--slow] [--only=3,7]

runs the notebook's unflagged and `cuda` cells in one shell (`slow`-only cells too with --slow;
with --only, just the listed cells beside every export and import cell), never stopping at an
error: it prints one line per failing cell and per `cuda` cell, and writes OUTDIR/<stem>.json,
{cell id: outputs} of the `cuda` cells. Back here:

    .venv/bin/python .ci/gpu_cells.py store OUTDIR/*.json

writes those outputs into nbs/<stem>.ipynb by cell id (cells that raised are left as they were).
"""

import argparse
import json
import re
import sys
import time
from pathlib import Path


def cell_flags(source: str) -> set[str]:
    "The `#| ...` directives of a cell."
    return {m.strip() for m in re.findall(r"^#\|\s*(.*)$", source, re.M)}


def is_setup(source: str, flags: set[str]) -> bool:
    "Export and import cells: what any other cell may need."
    return any(f.startswith("export") for f in flags) or bool(
        re.search(r"^(import|from) ", source, re.M)
    )


def run(path: str, outdir: str, slow: bool, only: set[int] | None) -> int:
    from execnb.nbio import read_nb
    from execnb.shell import CaptureShell

    nb, shell, kept, failed = read_nb(path), CaptureShell(path), {}, 0
    name = Path(path).name
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code":
            continue
        flags = cell_flags(c.source)
        if "eval: false" in flags or ("slow" in flags and "cuda" not in flags and not slow):
            continue
        if only is not None and i not in only and not is_setup(c.source, flags):
            continue
        t, shell.exc = time.perf_counter(), None
        shell.cell(c)
        dt, tag = time.perf_counter() - t, "cuda " if "cuda" in flags else ""
        if shell.exc is not None:
            failed += 1
            print(f"{name}[{i}] {tag}ERROR {dt:.1f}s: {shell.exc!r}", flush=True)
        elif "cuda" in flags:
            print(f"{name}[{i}] cuda ok {dt:.1f}s", flush=True)
        if "cuda" in flags:
            kept[c.id] = c.get("outputs", [])
    Path(outdir, Path(path).stem + ".json").write_text(json.dumps(kept, default=dict))
    return failed


def as_output(o: dict):
    "An execnb output as an nbformat output."
    import nbformat

    kind = o["output_type"]
    if kind == "stream":
        return nbformat.v4.new_output(kind, name=o.get("name", "stdout"), text="".join(o["text"]))
    data = {k: "".join(v) if isinstance(v, list) else v for k, v in o["data"].items()}
    extra = {"execution_count": None} if kind == "execute_result" else {}
    return nbformat.v4.new_output(kind, data=data, metadata=o.get("metadata", {}), **extra)


def store(paths: list[str]) -> None:
    import nbformat

    for p in paths:
        outs = json.loads(Path(p).read_text())
        nb_path = Path("nbs", Path(p).stem + ".ipynb")
        nb, n = nbformat.read(nb_path, as_version=4), 0
        for c in nb.cells:
            got = outs.get(c.get("id"))
            if got and not any(o["output_type"] == "error" for o in got):
                c.outputs, n = [as_output(o) for o in got], n + 1
        nbformat.write(nb, nb_path)
        print(f"{nb_path}: {n} cuda cells stored")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("notebook")
    r.add_argument("outdir")
    r.add_argument("--slow", action="store_true")
    r.add_argument("--only", type=lambda s: {int(x) for x in s.split(",")})
    s = sub.add_parser("store")
    s.add_argument("json", nargs="+")
    a = p.parse_args()
    if a.cmd == "run":
        sys.exit(1 if run(a.notebook, a.outdir, a.slow, a.only) else 0)
    store(a.json)


if __name__ == "__main__":
    main()
