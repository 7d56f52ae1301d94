"""Where the node cache's folder is, and opening it on a node's shared scratch safely.

Owns: the cache root of ``data.cache_dir`` (``resolve_cache_dir``), the dataset's folder name
(``dataset_key``), and opening ``<cache root>/hpctrain-<uid>/<key>`` so that nothing another user
planted there is followed or trusted (/dev/shm and /tmp are writable by every user of a node):
each folder below the cache root is created 0700 if missing, then opened relative to its parent's
descriptor with O_NOFOLLOW | O_DIRECTORY (a symlink fails: ELOOP) and checked with fstat (owner =
us, not writable by group/others) — never by path, so a folder swapped between check and use is
never the one used — and which files found in such a folder may be used (``trusted_file``: a
regular file of ours that nobody else can write).

Must never: follow a symlink below the cache root, use a folder another user owns or can write,
change the mode of anything not ours, or remove anything outside the folders it opened.
"""
from __future__ import annotations

import errno
import hashlib
import os
import stat


def resolve_cache_dir(setting: str, node_rank: int) -> str | None:
    """The node's cache root for ``data.cache_dir`` (None = cache off)."""
    if setting == "auto":
        base = os.environ.get("SLURM_TMPDIR") or os.environ.get("TMPDIR") or ""
    else:
        base = "" if setting in ("", "off", "none") else setting
    if not base:
        return None
    if "{node}" in base:
        return base.replace("{node}", str(node_rank))
    if os.environ.get("HPCTRAIN_RANKS_PER_NODE"):  # pretend nodes share a disk: one dir each
        return os.path.join(base, f"node{node_rank}")
    return base


def dataset_key(data_path: str, manifest_bytes: bytes | None = None) -> str:
    """Cache sub-directory name: a hash of the dataset's real path and manifest bytes (another
    dataset, a re-sharded one, or a copy elsewhere = another directory); ``manifest_bytes``: its
    manifest.json as already read (hpctrain.data.dataset.Dataset), else read here."""
    h = hashlib.sha256(os.path.realpath(data_path).encode() + b"\0")
    if manifest_bytes is None:
        with open(os.path.join(data_path, "manifest.json"), "rb") as f:
            manifest_bytes = f.read()
    h.update(manifest_bytes)
    return "hpctrain-" + h.hexdigest()[:16]


class UnsafeDir(Exception):
    """A cache folder that cannot be used safely: ``str(e)`` = "<path>: <why>"."""

    def __init__(self, path: str, why: str):
        super().__init__(f"{path}: {why}")
        self.path = path


def user_root_name() -> str:
    """The per-user folder under ``data.cache_dir`` (several users may share one scratch)."""
    return f"hpctrain-{os.geteuid()}"


def _unsafe_reason(st: os.stat_result) -> str | None:
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _open_child(parent_fd: int, name: str, path: str) -> int:
    """The descriptor of folder ``name`` in ``parent_fd`` (created 0700 if missing), checked."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeDir(path, "is a symlink or not a folder (not made by this user's hpctrain;"
                                  " remove it or set data.cache_dir elsewhere)") from None
        raise
    st = os.fstat(fd)
    why = _unsafe_reason(st)
    if why:
        os.close(fd)
        raise UnsafeDir(path, why + "; remove it or set data.cache_dir elsewhere")
    if stat.S_IMODE(st.st_mode) & 0o077:  # ours but readable by others: make it private
        os.fchmod(fd, 0o700)
    return fd


def _check_base(base: str, st: os.stat_result) -> None:
    """The configured folder may be root's or ours; others may write into it only when it is
    sticky (/dev/shm, /tmp: then nobody else can rename or remove our folder in it)."""
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafeDir(base, f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) "
                              f"or root; set data.cache_dir to a folder of yours")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UnsafeDir(base, f"writable by other users and not sticky (mode "
                              f"{stat.S_IMODE(st.st_mode):o}); set data.cache_dir elsewhere")


def open_private_dir(base: str, names: list[str]) -> tuple[int, str]:
    """(descriptor, path) of ``base/names[0]/.../names[-1]``; ``base`` (the configured cache
    folder, followed as named) is created if missing and must be root's or ours, and sticky if
    others can write it; every folder below it must be ours, not a symlink, not writable by
    others (UnsafeDir otherwise; OSError when it cannot be made)."""
    os.makedirs(base, mode=0o700, exist_ok=True)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    path = base
    try:
        _check_base(base, os.fstat(fd))
        for name in names:
            path = os.path.join(path, name)
            child = _open_child(fd, name, path)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd, path


def trusted_file(dir_fd: int, name: str) -> bool:
    """Whether entry ``name`` of the folder ``dir_fd`` is a regular file of ours that no other
    user can write (a symlink, a planted or a world-writable file is not)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and _unsafe_reason(st) is None
