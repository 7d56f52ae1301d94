"""What a checkpoint looks like on disk, and whether one is intact. No collectives, no torch.distributed.

Owns: directory names (`step_00000020`, and `.tmp[-<launch id>]` / `.old` / `.deleting` variants), the commit marker
(COMMIT.json: every file with its size, sha256 of the small files, xxh3-128 of the data files by default), durable
writes (write + flush + fsync, directory fsync), verification of one checkpoint, and reading its JSON
state. Every function here runs on ONE process (rank 0 in a job, or a user's shell). What happens to
the checkpoints of a run directory (listing, the newest intact one, install, retention) is directory.py.

It must never delete anything, never unpickle anything except through `safe_load.read_metadata` (or
metadata_scan.read_records, its torch-free twin for the check), and
never trust a directory name alone: a checkpoint is committed only if its COMMIT.json says so and the
files match.
"""
from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

from hpctrain.errors import CheckpointError  # noqa: F401 - re-exported

FORMAT = "hpctrain-checkpoint"
FORMAT_VERSION = 1
COMMIT_FILE = "COMMIT.json"
TRAINER_STATE_FILE = "trainer_state.json"   # the JSON state, {name: ...} (upgrade_trainer_state)
NONTENSOR_FILE = "state_nontensor.json"     # non-tensor leaves of the DCP state (optimizer hparams)
DCP_METADATA_FILE = ".metadata"
# Always checksummed (small); *.distcp files only with full checksums.
SMALL_FILES = (TRAINER_STATE_FILE, NONTENSOR_FILE, DCP_METADATA_FILE)

_NAME_RE = re.compile(r"^step_(\d+)(\.tmp(?:-[0-9a-f]+)?|\.old|\.deleting)?$")
_KINDS = {None: "checkpoint", ".tmp": "tmp", ".old": "aside", ".deleting": "trash"}
_HASH_CHUNK = 1 << 20


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


# What to do about a damaged checkpoint, by what opened it: `train` resumes, `sample` and
# `export` read one (their errors must not speak of training)
OLDER_ONE = {"resume": "resume from an older one",
             "sample": "sample an older one: give --checkpoint its step_N folder",
             "export": "export an older one: give --checkpoint its step_N folder",
             "load": "load an older one: give hpctrain.load its step_N folder or step=N"}


def read_trainer_state(ckpt: Path, use: str = "resume") -> dict:
    """The checkpoint's JSON state, {name: ...}; CheckpointError when it is not a JSON object or
    its counters are damaged (what to do: OLDER_ONE[use])."""
    try:
        state = json.loads((Path(ckpt) / TRAINER_STATE_FILE).read_bytes())
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{Path(ckpt) / TRAINER_STATE_FILE} unreadable ({e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{Path(ckpt) / TRAINER_STATE_FILE} is not a JSON object")
    state = upgrade_trainer_state(state)
    problem = state_problem(state) or _step_mismatch(Path(ckpt).name, state)
    if problem:
        raise CheckpointError(f"{Path(ckpt) / TRAINER_STATE_FILE}: {problem} (a damaged or "
                              f"hand-edited checkpoint; {OLDER_ONE[use]})")
    return state


# Counters of the JSON state that must be integers >= 0: {entry: keys} (a key may be absent)
_COUNTERS = {"trainer": ("step", "world_size"),
             "sampler": ("seed", "epoch", "position", "n_samples", "global_batch")}


def state_problem(state: dict) -> str | None:
    """What is wrong with the step and data position of a JSON state ({name: ...}), or None: every
    counter an integer >= 0, the sampler's position inside its dataset. A checksum proves the file
    is the one saved, not that what was saved (or edited and re-hashed) can be resumed."""
    for entry, keys in _COUNTERS.items():
        values = state.get(entry)
        if entry in state and not isinstance(values, dict):
            return f"'{entry}' is not a JSON object"
        for key in keys if values else ():
            v = values.get(key, 0)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                return f"'{entry}.{key}' is {v!r}, not an integer >= 0"
    sampler = state.get("sampler") or {}
    if "n_samples" in sampler and sampler.get("position", 0) > sampler["n_samples"]:
        return (f"'sampler.position' {sampler['position']} is past the dataset's "
                f"{sampler['n_samples']} samples")
    return None


def _step_mismatch(dir_name: str, state: dict) -> str | None:
    """A `step_N` folder whose trainer state holds another step (hand-edited, or copied into
    the wrong folder): resuming it would silently re-run or skip steps."""
    parsed = parse_dir_name(dir_name)
    step = (state.get("trainer") or {}).get("step")
    if parsed and parsed[1] == "checkpoint" and step is not None and step != parsed[0]:
        return f"'trainer.step' is {step}, but the folder is {dir_name}"
    return None


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def parse_dir_name(name: str) -> tuple[int, str] | None:
    """`step_00000020` -> (20, "checkpoint"); `.tmp` -> "tmp" (a save in progress or interrupted);
    `.old` -> "aside" (the previous copy during a re-save); `.deleting` -> "trash"; else None.
    A launch's own tmp dir, `.tmp-<launch id>`, is "tmp" too."""
    m = _NAME_RE.match(name)
    return (int(m.group(1)), _KINDS[(m.group(2) or "").split("-")[0] or None]) if m else None


def tmp_path(final: Path, launch: str | None = None) -> Path:
    """`step_N.tmp`, or `step_N.tmp-<launch>`: a launch's own (run_lock.launch_id()), so that a rank
    of an older launch frozen past the relaunch can never write into the newer one's save of the
    same step."""
    return final.with_name(final.name + ".tmp" + (f"-{launch}" if launch else ""))


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
    """Read into one reused 1 MiB buffer (no fresh bytes object per chunk; small enough to stay in
    the CPU cache between the copy and the hash)."""
    h, buf = new_hasher(kind), bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
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
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        return ["not a directory"], None, None
    try:
        commit = read_commit(ckpt)
    except CheckpointError as e:
        return [str(e)], None, None
    problems = _listed_file_problems(ckpt, commit, full)
    if problems:
        return problems, commit, None
    try:
        state = json.loads((ckpt / TRAINER_STATE_FILE).read_bytes())
    except (ValueError, OSError) as e:
        return [f"{TRAINER_STATE_FILE} unreadable ({e})"], commit, None
    if not isinstance(state, dict):
        return [f"{TRAINER_STATE_FILE} is not a JSON object"], commit, None
    problem, metadata, ends = _storage_ends(ckpt)
    if problem is not None:
        return [problem], commit, None
    files = commit["files"]
    for rel, end in sorted(ends.items()):
        if rel not in files:
            problems.append(f".metadata refers to {rel}, which {COMMIT_FILE} does not list")
        elif files[rel]["size"] < end:
            problems.append(f"{rel} is shorter ({files[rel]['size']} bytes) than .metadata needs ({end})")
    return problems, commit, (None if problems else metadata)


def _listed_file_problems(ckpt: Path, commit: dict, full: bool) -> list[str]:
    """The directory name's step, then every file COMMIT.json lists: present, its size, the
    sha256 of the small ones (of all, with ``full``).  A file outside the checkpoint is the only
    problem reported."""
    problems = []
    parsed = parse_dir_name(ckpt.name)
    if parsed and parsed[0] != commit["step"]:
        problems.append(f"{COMMIT_FILE} says step {commit['step']}, directory name says {parsed[0]}")
    files = commit["files"]
    outside = [rel for rel in files if os.path.isabs(rel) or ".." in Path(rel).parts]
    if outside:
        return [f"{COMMIT_FILE} lists files outside the checkpoint: {outside[:3]}"]
    for name in SMALL_FILES:
        if name not in files:
            problems.append(f"{COMMIT_FILE} does not list {name}")
    for rel, entry in sorted(files.items()):
        if (bad := _listed_file_problem(ckpt, rel, entry, full)) is not None:
            problems.append(bad)
    return problems


def _listed_file_problem(ckpt: Path, rel: str, entry, full: bool) -> str | None:
    """What is wrong with one file COMMIT.json lists (malformed entry, missing, size, sha256)."""
    if not isinstance(entry, dict):
        return f"{COMMIT_FILE} entry for {rel} is malformed"
    try:
        size = os.stat(ckpt / rel).st_size
    except FileNotFoundError:
        return f"{rel} is missing"
    except OSError as e:
        return f"{rel}: {e}"
    if size != entry.get("size"):
        return f"{rel} has {size} bytes, {COMMIT_FILE} says {entry.get('size')}"
    if rel in SMALL_FILES or full:
        return hash_problem(ckpt, rel, entry)
    return None


def _storage_ends(ckpt: Path):
    """(problem or None, the DCP metadata, {storage file: bytes .metadata needs of it}). Where torch
    is not loaded (`hpctrain ckpt list|verify`), the metadata is read as inert records under the
    same allow-list (metadata_scan.py): the same verdict and problems, without importing torch."""
    if "torch" in sys.modules:
        from hpctrain.checkpoint.safe_load import read_metadata  # the metadata a load uses
    else:
        from hpctrain.checkpoint.metadata_scan import read_records as read_metadata

    try:
        metadata = read_metadata(ckpt / DCP_METADATA_FILE)
        ends: dict[str, int] = {}
        for info in metadata.storage_data.values():
            rel = str(info.relative_path)
            if os.path.isabs(rel) or ".." in Path(rel).parts:
                return f".metadata points outside the checkpoint: {rel}", None, None
            ends[rel] = max(ends.get(rel, 0), int(info.offset) + int(info.length))
    except CheckpointError as e:
        return str(e), None, None
    except (AttributeError, TypeError, ValueError) as e:
        return f".metadata is malformed ({type(e).__name__}: {e})", None, None
    return None, metadata, ends


def verify_checkpoint(path: str | os.PathLike, full: bool = False) -> list[str]:
    """Problems with one checkpoint directory; empty if it is committed and intact."""
    return check_checkpoint(Path(path), full)[0]
