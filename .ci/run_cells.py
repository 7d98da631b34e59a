"""Execute chosen code cells of a notebook and store their outputs back, touching nothing else.

    .venv/bin/python .ci/run_cells.py nbs/X.ipynb --run 0-5 12 40 --store 40

`--run` lists cell indices (from 0, every cell counted; `a-b` is a range) executed in order in one
kernel; `--store` says which of them get their new outputs written back (default: all of them).
The notebook is read again just before writing and outputs are matched by cell id, so edits made
while the cells ran are kept. This is how slow measurement cells get their stored outputs without
re-running a whole notebook. Set OMP_NUM_THREADS / TRITON_INTERPRET yourself.
"""

import argparse
import copy
import os
import sys

import nbformat
from nbclient import NotebookClient


def indices(specs: list[str]) -> list[int]:
    out = []
    for s in specs:
        a, _, b = s.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("nb")
    p.add_argument("--run", nargs="+", required=True)
    p.add_argument("--store", nargs="*")
    p.add_argument("--timeout", type=int, default=1800)
    a = p.parse_args()
    nb = nbformat.read(a.nb, as_version=4)
    run = [i for i in indices(a.run) if nb.cells[i].cell_type == "code"]
    store = set(indices(a.store)) if a.store else set(run)
    sub = copy.deepcopy(nb)
    sub.cells = [copy.deepcopy(nb.cells[i]) for i in run]
    where = {"metadata": {"path": os.path.dirname(os.path.abspath(a.nb))}}
    NotebookClient(sub, timeout=a.timeout, kernel_name="python3", resources=where).execute()
    new = {c["id"]: c for c, i in zip(sub.cells, run) if i in store}
    fresh = nbformat.read(a.nb, as_version=4)
    for c in fresh.cells:
        if c.get("id") in new:
            c.outputs = new[c["id"]].outputs
            c.execution_count = None
    nbformat.write(fresh, a.nb)
    print(f"stored the outputs of {len(new)} cells in {a.nb}", file=sys.stderr)


if __name__ == "__main__":
    main()
