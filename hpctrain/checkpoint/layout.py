"""What a checkpoint looks like on disk, and whether one is intact. No collectives, no torch.distributed.

Owns: directory names (`step_00000020`, and `.tmp` / `.old` / `.deleting` variants), the commit marker
(COMMIT.json: every file with its size, sha256 of the small files, xxh3-128 of the data files by default), durable
writes (write + flush + fsync, directory fsync), verification, listing, choosing the newest intact
checkpoint, and removal (rename to `.deleting`, then delete). Every function here runs on ONE process
(rank 0 in a job, or a user's shell).

It must never delete a committed checkpoint other than through `remove_checkpoint` (retention and
re-saves), never unpickle anything except through `safe_load.read_metadata`, and never trust a
directory name alone: a checkpoint is committed only if its COMMIT.json says so and the files match.
"""
from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpctrain.checkpoint import faults
from hpctrain.errors import CheckpointError, NoIntactCheckpoint  # noqa: F401 - re-exported

FORMAT = "hpctrain-checkpoint"
FORMAT_VERSION = 1
COMMIT_FILE = "COMMIT.json"
TRAINER_STATE_FILE = "trainer_state.json"   # the JSON state, {name: ...} (upgrade_trainer_state)
NONTENSOR_FILE = "state_nontensor.json"     # non-tensor leaves of the DCP state (optimizer hparams)
DCP_METADATA_FILE = ".metadata"
# Always checksummed (small); *.distcp files only with full checksums.
SMALL_FILES = (TRAINER_STATE_FILE, NONTENSOR_FILE, DCP_METADATA_FILE)

_NAME_RE = re.compile(r"^step_(\d+)(\.tmp|\.old|\.deleting)?$")
_KINDS = {None: "checkpoint", ".tmp": "tmp", ".old": "aside", ".deleting": "trash"}
_HASH_CHUNK = 8 << 20


# Before the checkpoint was assembled from Stateful objects, the trainer's entries sat at the top.
_TRAINER_KEYS = ("step", "world_size", "config", "tokenizer")


def upgrade_trainer_state(state: dict) -> dict:
    """trainer_state.json as {name: JSON state}, whichever version wrote it: older checkpoints
    kept step / world_size / config / tokenizer at the top level, now under "trainer"."""
    if "trainer" in state or "step" not in state:
        return state
    out = {k: v for k, v in state.items() if k not in _TRAINER_KEYS}
    out["trainer"] = {k: state[k] for k in _TRAINER_KEYS if k in state}
    return out


def read_trainer_state(ckpt: Path) -> dict:
    """The checkpoint's JSON state, {name: ...}; CheckpointError when it is not a JSON object."""
    try:
        state = json.loads((Path(ckpt) / TRAINER_STATE_FILE).read_bytes())
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{Path(ckpt) / TRAINER_STATE_FILE} unreadable ({e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{Path(ckpt) / TRAINER_STATE_FILE} is not a JSON object")
    return upgrade_trainer_state(state)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def parse_dir_name(name: str) -> tuple[int, str] | None:
    """`step_00000020` -> (20, "checkpoint"); `.tmp` -> "tmp" (a save in progress or interrupted);
    `.old` -> "aside" (the previous copy during a re-save); `.deleting` -> "trash"; else None."""
    m = _NAME_RE.match(name)
    return (int(m.group(1)), _KINDS[m.group(2)]) if m else None


def tmp_path(final: Path) -> Path:
    return final.with_name(final.name + ".tmp")


def aside_path(final: Path) -> Path:
    return final.with_name(final.name + ".old")


# ----------------------------------------------------------------------------------------------
# Durable file-system primitives
# ----------------------------------------------------------------------------------------------

def fsync_dir(path: Path) -> None:
    """fsync a directory so renames/creates in it survive a crash; a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes) -> None:
    """write + flush + fsync."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_json_durably(path: Path, obj) -> None:
    write_bytes_durably(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def sha256_file(path: Path) -> str:
    return hash_file(path, "sha256")


# Tensor data files are checksummed with xxh3-128 (xxhash: ~15 GB/s per core here, sha256
# ~1.2 GB/s), computed by each rank while it writes; the small files keep sha256.
DATA_HASH = "xxh3_128"


def new_hasher(kind: str):
    if kind == DATA_HASH:
        import xxhash

        return xxhash.xxh3_128()
    return hashlib.new(kind)


def hash_file(path: Path, kind: str) -> str:
    h = new_hasher(kind)
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def recorded_hash(entry: dict) -> tuple[str, str] | None:
    """(kind, hex digest) a COMMIT.json file entry records, if any."""
    for kind in (DATA_HASH, "sha256"):
        if kind in entry:
            return kind, entry[kind]
    return None


def hash_problem(ckpt: Path, rel: str, entry: dict) -> str | None:
    """One line if ``rel`` does not match the checksum COMMIT.json records for it."""
    rec = recorded_hash(entry)
    if rec is not None and hash_file(ckpt / rel, rec[0]) != rec[1]:
        return f"{rel} does not match its {rec[0]} in {COMMIT_FILE}"
    return None


def list_files(ckpt: Path) -> list[str]:
    """Relative paths of all regular files in a checkpoint dir, except COMMIT.json, sorted."""
    out = []
    for dirpath, _, files in os.walk(ckpt):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), ckpt)
            if rel != COMMIT_FILE:
                out.append(rel)
    return sorted(out)


def write_commit(ckpt: Path, step: int, world_size: int, data_hashes: dict[str, str]) -> dict:
    """Write COMMIT.json LAST into `ckpt`: every file with its size; sha256 of the small files and
    the xxh3-128 of any file in `data_hashes` (full checksums, computed by the ranks that wrote
    them, while writing)."""
    files = {}
    for rel in list_files(ckpt):
        entry = {"size": os.stat(ckpt / rel).st_size}
        if rel in SMALL_FILES:
            entry["sha256"] = sha256_file(ckpt / rel)
        elif rel in data_hashes:
            entry[DATA_HASH] = data_hashes[rel]
        files[rel] = entry
    missing = [f for f in SMALL_FILES if f not in files]
    if missing:
        raise CheckpointError(f"{ckpt}: missing {', '.join(missing)} at commit time")
    now = time.time()
    commit = {
        "format": FORMAT, "version": FORMAT_VERSION, "step": step, "world_size": world_size,
        "time": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "unix_time": now, "checksums": "full" if data_hashes else "small-files", "files": files,
    }
    write_json_durably(ckpt / COMMIT_FILE, commit)
    return commit


def read_commit(ckpt: Path) -> dict:
    """Parse COMMIT.json; raises CheckpointError with the reason if absent or malformed."""
    p = ckpt / COMMIT_FILE
    try:
        commit = json.loads(p.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"no {COMMIT_FILE} (save did not finish)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{COMMIT_FILE} unreadable ({e})") from None
    if not isinstance(commit, dict) or commit.get("format") != FORMAT:
        raise CheckpointError(f"{COMMIT_FILE} is not an {FORMAT} marker")
    if commit.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{COMMIT_FILE} has format version {commit.get('version')!r}, "
                              f"this hpctrain reads version {FORMAT_VERSION}")
    if not isinstance(commit.get("files"), dict) or not isinstance(commit.get("step"), int):
        raise CheckpointError(f"{COMMIT_FILE} lacks 'files' or 'step'")
    return commit


# ----------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------

def check_checkpoint(ckpt: Path, full: bool = False):
    """(problems, commit, dcp_metadata). Quick by default: sizes of all files, sha256 of the small
    ones, a safe parse of `.metadata` (every storage file it names is listed and long enough).
    `full` also checks the checksums of data files when COMMIT.json recorded them."""
    from hpctrain.checkpoint.safe_load import read_metadata  # here: layout itself needs no torch

    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        return ["not a directory"], None, None
    try:
        commit = read_commit(ckpt)
    except CheckpointError as e:
        return [str(e)], None, None
    problems = []
    parsed = parse_dir_name(ckpt.name)
    if parsed and parsed[0] != commit["step"]:
        problems.append(f"{COMMIT_FILE} says step {commit['step']}, directory name says {parsed[0]}")
    files = commit["files"]
    outside = [rel for rel in files if os.path.isabs(rel) or ".." in Path(rel).parts]
    if outside:
        return [f"{COMMIT_FILE} lists files outside the checkpoint: {outside[:3]}"], commit, None
    for name in SMALL_FILES:
        if name not in files:
            problems.append(f"{COMMIT_FILE} does not list {name}")
    for rel, entry in sorted(files.items()):
        p = ckpt / rel
        if not isinstance(entry, dict):
            problems.append(f"{COMMIT_FILE} entry for {rel} is malformed")
            continue
        try:
            size = os.stat(p).st_size
        except FileNotFoundError:
            problems.append(f"{rel} is missing")
            continue
        except OSError as e:
            problems.append(f"{rel}: {e}")
            continue
        if size != entry.get("size"):
            problems.append(f"{rel} has {size} bytes, {COMMIT_FILE} says {entry.get('size')}")
            continue
        if rel in SMALL_FILES or full:
            if (bad := hash_problem(ckpt, rel, entry)) is not None:
                problems.append(bad)
    if problems:
        return problems, commit, None
    try:
        state = json.loads((ckpt / TRAINER_STATE_FILE).read_bytes())
    except (ValueError, OSError) as e:
        return [f"{TRAINER_STATE_FILE} unreadable ({e})"], commit, None
    if not isinstance(state, dict):
        return [f"{TRAINER_STATE_FILE} is not a JSON object"], commit, None
    try:
        metadata = read_metadata(ckpt / DCP_METADATA_FILE)
        ends: dict[str, int] = {}
        for info in metadata.storage_data.values():
            rel = str(info.relative_path)
            if os.path.isabs(rel) or ".." in Path(rel).parts:
                return [f".metadata points outside the checkpoint: {rel}"], commit, None
            ends[rel] = max(ends.get(rel, 0), int(info.offset) + int(info.length))
    except CheckpointError as e:
        return [str(e)], commit, None
    except (AttributeError, TypeError, ValueError) as e:
        return [f".metadata is malformed ({type(e).__name__}: {e})"], commit, None
    for rel, end in sorted(ends.items()):
        if rel not in files:
            problems.append(f".metadata refers to {rel}, which {COMMIT_FILE} does not list")
        elif files[rel]["size"] < end:
            problems.append(f"{rel} is shorter ({files[rel]['size']} bytes) than .metadata needs ({end})")
    return problems, commit, (None if problems else metadata)


def verify_checkpoint(path: str | os.PathLike, full: bool = False) -> list[str]:
    """Problems with one checkpoint directory; empty if it is committed and intact."""
    return check_checkpoint(Path(path), full)[0]


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


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def find_latest(root: Path, skip=()):
    """(path, dcp_metadata) of the newest committed and intact checkpoint not in ``skip`` (ones
    that failed while loading), or (None, None) when root holds no checkpoint at all. Skipped
    candidates get a one-line warning; `.tmp` dirs are ignored silently. Checkpoints that exist
    but are all unusable raise NoIntactCheckpoint: training must not silently start over."""
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
        warn(f"skipping checkpoint {path}: {problems[0]}{more}")
    if seen:
        names = ", ".join(p.name for p in seen[:3]) + (f" (+{len(seen) - 3} more)" if len(seen) > 3 else "")
        raise NoIntactCheckpoint(
            f"{root}: {len(seen)} checkpoint(s) ({names}), none intact (see the lines above, or "
            f"`hpctrain ckpt list {root}`); refusing to start over from step 0 in a run directory "
            f"with history: repair or move them aside, or use a new run.dir to start afresh")
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


def prune(root: Path, keep: int) -> list[Path]:
    """Keep the newest `keep` intact checkpoints; remove older intact ones, every `.tmp` and
    `.deleting` dir, and aside copies whose step has an intact checkpoint. Corrupt or marker-less
    `step_*` dirs are left for a human (never chosen by `find_latest`). Returns what was removed."""
    removed = []
    entries = scan(root)
    intact = [(s, p) for s, k, p in entries if k == "checkpoint" and not verify_checkpoint(p)]
    intact_steps = {s for s, _ in intact}
    doomed = [p for _, p in intact[keep:]]
    doomed += [p for s, k, p in entries if k in ("tmp", "trash")]
    doomed += [p for s, k, p in entries if k == "aside" and s in intact_steps]
    for p in doomed:
        try:
            if p.name.endswith((".tmp", ".deleting")):
                shutil.rmtree(p)
            else:
                remove_checkpoint(p)
            removed.append(p)
        except OSError as e:
            warn(f"could not remove old checkpoint {p}: {e}")
    if removed:
        fsync_dir(root)
    return removed
