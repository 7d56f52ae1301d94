"""The checkpoints of one run directory: listing them, choosing the newest intact one, installing a
new one (renaming a re-saved step's old copy aside only then) and retention (rename to `.deleting`,
then delete). One process (rank 0 in a job, or a user's shell); no collectives.

It must never delete a committed checkpoint other than through `remove_checkpoint` (retention and
re-saves), and never trust a directory name alone (disk_format.check_checkpoint decides).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from hpctrain import logs
from hpctrain.checkpoint import faults
from hpctrain.checkpoint.disk_format import (COMMIT_FILE, aside_path, check_checkpoint, fsync_dir, list_files, parse_dir_name, step_dir_name, verify_checkpoint)
from hpctrain.errors import NoIntactCheckpoint

log = logs.get_logger(__name__)


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    kind: str                 # "checkpoint" | "tmp" | "aside" | "trash" (see parse_dir_name)
    status: str               # "committed" | "incomplete" | "corrupt"
    problems: list[str] = field(default_factory=list)
    time: str | None = None   # commit time (UTC, ISO 8601)
    size_bytes: int = 0


def scan(root: Path) -> list[tuple[int, str, Path]]:
    """(step, kind, path) of every step_* entry in root, newest first; for one step a real
    checkpoint sorts before its aside copy. Missing root -> []."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    order = {"checkpoint": 0, "aside": 1, "tmp": 2, "trash": 3}
    found = [(*parsed, Path(root) / n) for n in names if (parsed := parse_dir_name(n))]
    return sorted(found, key=lambda e: (-e[0], order[e[1]]))


def list_checkpoints(root: str | os.PathLike, full: bool = False) -> list[CheckpointInfo]:
    """Every step_* directory under root with its status, newest first (for `hpctrain ckpt list`)."""
    out = []
    for step, kind, path in scan(Path(root)):
        size = sum(os.stat(path / rel).st_size for rel in _safe_list(path))
        if kind in ("tmp", "trash"):
            why = "save in progress or interrupted" if kind == "tmp" else "deletion interrupted"
            out.append(CheckpointInfo(path, step, kind, "incomplete", [why], None, size))
            continue
        problems, commit, _ = check_checkpoint(path, full)
        if commit is None:
            status = "incomplete" if not (path / COMMIT_FILE).exists() else "corrupt"
        else:
            status = "corrupt" if problems else "committed"
        out.append(CheckpointInfo(path, step, kind, status, problems,
                                  commit.get("time") if commit else None, size))
    return out


def _safe_list(path: Path) -> list[str]:
    try:
        return list_files(path)
    except OSError:
        return []


# What to do when a root's checkpoints are all damaged, by what looked for one (train resumes;
# `sample`, `export` and hpctrain.load read one: their errors must not speak of training)
NONE_INTACT_HINT = {
    "resume": "refusing to start over from step 0 in a run directory with history: repair or "
              "move them aside, or use a new run.dir to start afresh",
    "sample": "nothing to sample: repair one, or give --checkpoint another run or step_N folder",
    "export": "nothing to export: repair one, or give --checkpoint another run or step_N folder",
    "load": "nothing to load: repair one, or give hpctrain.load another run or step_N folder"}


def find_latest(root: Path, skip=(), use: str = "resume"):
    """(path, dcp_metadata) of the newest committed and intact checkpoint not in ``skip`` (ones
    that failed while loading), or (None, None) when root holds no checkpoint at all. Skipped
    candidates get a one-line warning; `.tmp` dirs are ignored silently. Checkpoints that exist
    but are all unusable raise NoIntactCheckpoint (what to do: NONE_INTACT_HINT[use]): training
    must not silently start over."""
    skip = {Path(p) for p in skip}
    seen = []
    for step, kind, path in scan(root):
        if kind in ("tmp", "trash"):
            continue
        seen.append(path)
        if path in skip:
            continue
        problems, _, metadata = check_checkpoint(path)
        if not problems:
            return path, metadata
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        log.warning(f"warning: skipping checkpoint {path}: {problems[0]}{more}")
    if seen:
        names = ", ".join(p.name for p in seen[:3]) + (f" (+{len(seen) - 3} more)" if len(seen) > 3 else "")
        raise NoIntactCheckpoint(
            f"{root}: {len(seen)} checkpoint(s) ({names}), none intact (see the lines above, or "
            f"`hpctrain ckpt list {root}`); {NONE_INTACT_HINT[use]}")
    return None, None


# ----------------------------------------------------------------------------------------------
# Removal and replacement (rank 0 only)
# ----------------------------------------------------------------------------------------------

def remove_checkpoint(path: Path) -> None:
    """Rename to `step_N.deleting` (one atomic step out of the candidate set), then delete; a crash
    mid-delete leaves only a `.deleting` dir, which the next retention pass removes."""
    parsed = parse_dir_name(path.name)
    trash = path.with_name(f"{step_dir_name(parsed[0])}.deleting") if parsed else None
    if trash is None or trash == path:
        shutil.rmtree(path)
        return
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(path, trash)
    fsync_dir(path.parent)
    faults.hit("retention.renamed")
    shutil.rmtree(trash)


def install(tmp: Path, final: Path) -> None:
    """Atomically publish `tmp` as `final`. If `final` exists (re-saving a step), it is first renamed
    aside, so that at every moment an intact copy of this step exists under a name `find_latest`
    considers; the aside copy is removed only after the new one is in place and the rename durable."""
    root = final.parent
    aside = aside_path(final)
    if final.exists():
        if aside.exists():  # left by an earlier crash: keep whichever of the two is intact
            if verify_checkpoint(final):
                remove_checkpoint(final)
            else:
                remove_checkpoint(aside)
        if final.exists():
            os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except OSError:
        if aside.exists() and not final.exists():
            os.rename(aside, final)
        raise
    faults.hit("commit.renamed")
    fsync_dir(root)
    if aside.exists():
        remove_checkpoint(aside)


# Retention runs at every save and must tell intact checkpoints from corrupt ones among all it keeps
# (with checkpoint.keep = 100, 100 quick checks per save: the safe parse of each `.metadata` is
# most of a small run's save time). A checkpoint that passed is not checked again while every file
# in it has the same inode, size, mtime and ctime (a truncated, replaced or edited file changes
# them); only this process's verdicts, only "intact" ones.
_intact_files: dict[Path, tuple] = {}


def _files_as_they_are(path: Path) -> tuple | None:
    try:
        found = []
        for folder, _, names in os.walk(path):
            for name in names:
                st = os.stat(os.path.join(folder, name), follow_symlinks=False)
                found.append((os.path.join(folder, name), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return tuple(sorted(found))
    except OSError:
        return None


def _intact(path: Path) -> bool:
    """verify_checkpoint(path) finds nothing; remembered while the checkpoint's files stay as they were."""
    files = _files_as_they_are(path)
    if files is not None and _intact_files.get(path) == files:
        return True
    intact = not verify_checkpoint(path)
    if intact and files is not None:
        _intact_files[path] = files
    else:
        _intact_files.pop(path, None)
    return intact


def prune(root: Path, keep: int) -> list[Path]:
    """Keep the newest `keep` intact checkpoints; remove older intact ones, every `.tmp` and
    `.deleting` dir, and aside copies whose step has an intact checkpoint. Corrupt or marker-less
    `step_*` dirs are left for a human (never chosen by `find_latest`). Returns what was removed."""
    removed = []
    entries = scan(root)
    intact = [(s, p) for s, k, p in entries if k == "checkpoint" and _intact(p)]
    intact_steps = {s for s, _ in intact}
    doomed = [p for _, p in intact[keep:]]
    doomed += [p for s, k, p in entries if k in ("tmp", "trash")]
    doomed += [p for s, k, p in entries if k == "aside" and s in intact_steps]
    for p in doomed:
        try:
            if parse_dir_name(p.name)[1] in ("tmp", "trash"):
                shutil.rmtree(p)
            else:
                remove_checkpoint(p)
            removed.append(p)
            _intact_files.pop(p, None)
        except OSError as e:
            log.warning(f"warning: could not remove old checkpoint {p}: {e}")
    if removed:
        fsync_dir(root)
    return removed
