"""Writing into the node cache's folder: one shard's copy, and the small files beside it.

Owns: copying a shard from data.path into the cache folder (by its descriptor: temp files are
created O_EXCL | O_NOFOLLOW, mode 0600, so nothing planted is written through) while hashing it,
the size/sha256 check against the manifest, replacing a file atomically (temp + rename), and
telling a failing source (DataError naming the shard on data.path: the job stops) from a failing
cache disk (CacheWriteFailed: full or read-only; the node then reads data.path).

Must never: write to data.path, leave a temp file behind after a failure it saw, or name a file
outside the cache folder's descriptor as a destination.
"""
from __future__ import annotations

import hashlib
import os

from data_tools.format import TMP_PREFIX, DataError

COPY_BUF = 8 << 20
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class CacheWriteFailed(Exception):
    """Writing into the cache folder failed (full, read-only): the node reads data.path."""


def copy_and_hash(src: str, dir_fd: int, tmp: str | None) -> tuple[int, str]:
    """Read ``src`` (copying it into file ``tmp`` of the folder ``dir_fd``, unless None):
    (bytes, sha256 hex).  Reading fails with a DataError naming ``src``; writing with
    CacheWriteFailed (``tmp`` removed)."""
    h, n, out = hashlib.sha256(), 0, None
    try:
        with open(src, "rb", buffering=0) as fin:
            if tmp is not None:
                out = _create(dir_fd, tmp)
            buf = bytearray(COPY_BUF)
            view = memoryview(buf)
            while got := fin.readinto(buf):
                h.update(view[:got])
                n += got
                if out is not None:
                    _write_all(out, view[:got])
    except FileNotFoundError:
        raise DataError(src, "missing (listed in manifest)") from None
    except OSError as err:
        raise DataError(src, f"cannot read ({err.strerror or err})") from None
    except CacheWriteFailed:
        unlink_quietly(dir_fd, tmp)
        raise
    finally:
        if out is not None:
            os.close(out)
    return n, h.hexdigest()


def _create(dir_fd: int, name: str) -> int:
    try:
        return os.open(name, NEW_FILE, 0o600, dir_fd=dir_fd)
    except OSError as err:
        raise CacheWriteFailed(f"cannot create {name} ({err.strerror or err})") from None


def _write_all(fd: int, data: memoryview) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError as err:
        raise CacheWriteFailed(err.strerror or str(err)) from None


def check_copy(src: str, entry: dict, n: int, digest: str) -> None:
    """DataError naming ``src`` unless ``n`` bytes with sha256 ``digest`` are what the manifest
    ``entry`` lists."""
    if n != entry["bytes"] or digest != entry["sha256"]:
        what = (f"truncated ({n} bytes, manifest says {entry['bytes']})" if n < entry["bytes"] else
                f"sha256 mismatch (manifest {entry['sha256'][:12]}…, file {digest[:12]}…)")
        raise DataError(src, what + " while staging into the node cache")


def write_file(dir_fd: int, name: str, data: bytes) -> None:
    """Replace file ``name`` of the folder ``dir_fd`` by ``data`` (temp file + rename)."""
    tmp = f"{TMP_PREFIX}{os.getpid()}-{name}"
    unlink_quietly(dir_fd, tmp)  # a crash's leftover of this pid
    fd = os.open(tmp, NEW_FILE, 0o600, dir_fd=dir_fd)
    try:
        with open(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        unlink_quietly(dir_fd, tmp)
        raise


def unlink_quietly(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
