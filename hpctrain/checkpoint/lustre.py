"""Lustre striping of the checkpoint directory: detected, set once per run by rank 0, never fatal.

Owns: whether a path is on Lustre (`/proc/mounts`: the fstype of the longest mount point above
it; HPCTRAIN_FSTYPE pretends a type, for tests), the stripe count a layout gets by default, and
the one `lfs setstripe -c COUNT -S SIZE DIR` on the checkpoint root before the first save writes
(new step directories and their files inherit a directory's default layout on Lustre). A missing
or failing `lfs` is one warning line; the save goes on with the file system's default layout.

Default stripe count (checkpoint.stripe_count = 0, "auto"):
- layout "rank": 1. Each rank writes its own file at once; with one OST per file the files of a
  save already spread over the OSTs, and more stripes per file only add OST lock traffic (a
  thousand writers each touching every OST).
- layout "node": 4. A node's file holds all its ranks' shards (GBs), written by one leader: a few
  stripes let that one stream use several OSTs, while N node files x 4 stripes still spread over
  the OSTs instead of every leader contending for all of them (-1).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from hpctrain import logs

FSTYPE_ENV = "HPCTRAIN_FSTYPE"  # tests: pretend the run directory's file system type
AUTO_STRIPES = {"rank": 1, "node": 4}
LFS_TIMEOUT_S = 30.0


def fs_type(path: Path) -> str:
    """The file system type of `path` (the nearest existing parent), from /proc/mounts."""
    forced = os.environ.get(FSTYPE_ENV)
    if forced:
        return forced
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    real, best, kind = os.path.realpath(path), "", ""
    try:
        with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, parts[2]
    except OSError:
        return ""
    return kind


def stripe_count(configured: int, layout: str) -> int:
    """The `lfs setstripe -c` value: the configured one, or the layout's default for 0."""
    return configured if configured else AUTO_STRIPES[layout]


class Striping:
    """`apply(root)` sets the layout on `root` the first time it is called (rank 0 only)."""

    def __init__(self, count: int, size: str):
        self.count, self.size = count, size
        self.done = False

    def apply(self, root: Path) -> None:
        if self.done:
            return
        self.done = True
        if fs_type(root) != "lustre":
            return
        lfs = shutil.which("lfs")
        cmd = ["lfs", "setstripe", "-c", str(self.count), "-S", self.size, str(root)]
        why = None
        if lfs is None:
            why = "no `lfs` command on PATH"
        else:
            try:
                done = subprocess.run([lfs] + cmd[1:], capture_output=True, text=True,
                                      timeout=LFS_TIMEOUT_S)
                if done.returncode != 0:
                    last = (done.stderr or done.stdout).strip().splitlines()
                    why = f"exit {done.returncode}" + (f": {last[-1]}" if last else "")
            except (OSError, subprocess.TimeoutExpired) as e:
                why = f"{type(e).__name__}: {e}"
        if why:
            logs.warning(f"warning: {' '.join(cmd)} failed ({why}); checkpoints in {root} keep "
                         f"the file system's default striping (checkpoint.stripe_count)")
