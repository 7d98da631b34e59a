"""nbdev_export that lets one notebook export several fresh modules (`#| export layers`).

nbdev 2.4.14 treats `#| export mod` as "append to a module another notebook created":
the file must already exist, and every run appends the cells again. Here the first time a
run meets a module it writes it fresh (as for a `default_exp`), later cells append.
"""

from pathlib import Path

from nbdev import maker
from nbdev.doclinks import nbdev_export

_init = maker.ModuleMaker.__init__
_seen: set = set()


def _fresh_once(self, dest, name, nb_path, is_new=True, parse=True, solo_nb=False):
    fname = (Path(dest) / (name.replace(".", "/") + ".py")).resolve()
    if not is_new and fname not in _seen:
        is_new = True  # first write of this module in this run: start the file afresh
    _seen.add(fname)
    _init(self, dest, name, nb_path, is_new=is_new, parse=parse, solo_nb=solo_nb)


maker.ModuleMaker.__init__ = _fresh_once

if __name__ == "__main__":
    nbdev_export()
