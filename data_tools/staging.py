"""Build a dataset beside its destination and swap it in only when it is complete.

Owns: deciding whether ``--output`` may be replaced (new, empty, or an intact hpctrain dataset),
the staging folder ``.NAME.hpctrain-partial`` next to it (same parent, so same file system: the
swap is a rename), the swap itself, and removing the staging folder after a failure.

Must never: modify anything at ``--output`` before the new dataset is complete (a misspelled
input, bad bytes, a full disk or Ctrl-C leave the old dataset byte for byte), or replace a folder
that is not an intact dataset of ours (a folder of shard-named files without a manifest may be
someone's only copy: refused, not emptied).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil

from .format import MANIFEST_NAME, SHARD_RE, TMP_PREFIX, DataError, fsync_path, read_manifest

STAGING_SUFFIX = ".hpctrain-partial"
RETIRED_SUFFIX = ".hpctrain-old"
RENAME_EXCHANGE = 2  # renameat2(2) flag: swap two paths atomically (Linux >= 3.15)


def staging_dir(output: str) -> str:
    """Where the new dataset is built: beside ``output`` (its real path), hidden."""
    real = os.path.realpath(output)
    parent, name = os.path.split(real)
    return os.path.join(parent, f".{name}{STAGING_SUFFIX}")


def check_output(output: str, *dataset_files: str) -> None:
    """Refuse an ``output`` that is not new, empty or an intact dataset; change nothing."""
    if not os.path.exists(output):
        return
    if not os.path.isdir(output):
        raise DataError(output, "exists and is not a directory")
    entries = sorted(e for e in os.listdir(output) if not e.startswith(TMP_PREFIX))
    foreign = [e for e in entries if not (e in (MANIFEST_NAME, *dataset_files) or SHARD_RE.match(e))]
    if foreign:
        raise DataError(output, f"not empty and not an hpctrain dataset (found {foreign[0]!r}); "
                                f"refusing to overwrite — use a new or empty directory")
    if entries and MANIFEST_NAME not in entries:
        raise DataError(output, f"holds shard files ({entries[0]!r}) but no {MANIFEST_NAME}: an "
                                f"incomplete or damaged dataset; refusing to overwrite — remove it "
                                f"yourself or use a new directory")
    if entries:
        try:
            read_manifest(output)
        except DataError as e:
            raise DataError(output, f"refusing to overwrite: {e}") from None


def begin(output: str) -> str:
    """Create an empty staging folder beside ``output`` (checked by `check_output` first; a stale
    staging folder from a killed run is removed: the caller holds the output's lock
    (output_lock.py), so no live run owns it).  Returns its path."""
    staging = staging_dir(output)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        os.makedirs(staging)
    except OSError as e:
        raise DataError(os.path.dirname(staging), f"cannot create the staging folder for "
                                                  f"{output} here ({e.strerror}): the new dataset "
                                                  f"is built beside --output; make this folder "
                                                  f"writable or choose another --output") from None
    return staging


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where unsupported
    (older kernels, some parallel file systems, non-Linux)."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    at_fdcwd = -100
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE) == 0


def commit(staging: str, output: str) -> None:
    """Put the complete dataset at ``output``; the previous contents are removed only after."""
    real = os.path.realpath(output)
    parent = os.path.dirname(real)
    if not os.path.exists(real):
        os.rename(staging, real)
    elif _exchange(staging, real):
        shutil.rmtree(staging)  # now holds the previous dataset
    else:  # two renames; a crash between them leaves the old dataset at .NAME.hpctrain-old
        retired = os.path.join(parent, f".{os.path.basename(real)}{RETIRED_SUFFIX}")
        shutil.rmtree(retired, ignore_errors=True)
        os.rename(real, retired)
        os.rename(staging, real)
        shutil.rmtree(retired)
    fsync_path(parent)


def abandon(staging: str | None) -> None:
    """Remove a staging folder after a failure (the destination was never touched)."""
    if staging:
        shutil.rmtree(staging, ignore_errors=True)
