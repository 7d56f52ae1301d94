"""A fixture's work done once per pytest session, shared by pytest-xdist's workers.

`make test` runs two xdist workers; a module-scoped fixture is set up on every worker that runs one
of the module's tests, and xdist splits a module's parametrized tests between workers, so both
trained the same reference runs (test_moe_tp.py's: 61 s of setup on each worker in one CI run).
`shared_dir(tmp_path_factory, name, build)` runs `build(dir)` once per session under an exclusive
lock in a directory every worker of the session sees; a worker that comes while it is built waits
for it, and one that comes later reads it. A build that failed leaves no mark: the next asks again.

A shared directory is read-only for tests: a test writes what it makes under its own tmp_path.
"""
from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable

BUILT = ".built"  # written after `build` returned: the directory is whole


def session_root(tmp_path_factory) -> Path:
    """The folder this session's workers share: the session's base temp dir (a worker's own base
    temp dir is `popen-gwN` inside it); without xdist, the session's own."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    return root


def shared_dir(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """root/NAME, filled by `build(root/NAME)` by the first worker of the session that asks."""
    root = session_root(tmp_path_factory)
    out = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (out / BUILT).exists():
            shutil.rmtree(out, ignore_errors=True)  # a failed build's leftovers
            out.mkdir()
            build(out)
            (out / BUILT).write_text(os.environ.get("PYTEST_XDIST_WORKER", "main"))
    return out
