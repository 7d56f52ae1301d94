"""One writer per dataset: an exclusive flock on a lock file beside ``--output``.

Owns ``.NAME.hpctrain-lock`` next to a dataset's ``--output`` (the same parent as the staging
folder, see staging.py): the writer (rank 0 of ``shard``, ``blend``) holds an ``fcntl.flock`` on it
for its whole run, with its pid, host and start time written inside, so a second run onto the same
output is refused at once with one line naming the holder.  The kernel drops the lock when the
holder dies (no stale locks to take over); the holder unlinks the file when it releases it, and a
taker checks that the file it locked is still the one at the path (else retries).  Where the file
system has no flock (Lustre mounted without ``-o flock``), a warning and no lock.

Must never: wait for a lock (a second run is refused, not queued), or remove anything but its own
lock file.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from . import logs
from .format import DataError

log = logs.get_logger(__name__)

LOCK_SUFFIX = ".hpctrain-lock"
_NO_FLOCK = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)


def lock_path(output: str) -> str:
    """``.NAME.hpctrain-lock`` beside ``output`` (its real path), hidden."""
    parent, name = os.path.split(os.path.realpath(output))
    return os.path.join(parent, f".{name}{LOCK_SUFFIX}")


def _holder(fd: int) -> str:
    try:
        who = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError, RecursionError):  # a lock file planted or cut short
        who = {}
    if not who or not isinstance(who, dict):
        return "a run that is just starting"
    return f"pid {who.get('pid', '?')} on {who.get('host', '?')}, started " \
           f"{time.strftime('%H:%M:%S', time.localtime(who.get('started', 0)))}"


class OutputLock:
    """``with OutputLock(output):`` — hold the output's lock or raise DataError naming the holder."""

    def __init__(self, output: str):
        self.output, self.path, self.fd = str(output), lock_path(output), None

    def acquire(self) -> "OutputLock":
        for _ in range(10):
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise DataError(self.output, f"another run is writing this dataset ({holder}; "
                                             f"lock {self.path}); wait for it to end, or choose "
                                             f"another --output") from None
            except OSError as e:
                os.close(fd)
                if e.errno not in _NO_FLOCK:
                    raise
                log.warning(
                    f"warning: {self.path}: this file system has no flock ({e.strerror}); "
                    f"nothing stops two runs writing {self.output} at once")
                return self
            if self._still_linked(fd):
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                          "started": time.time()}).encode() + b"\n", 0)
                self.fd = fd
                return self
            os.close(fd)  # the holder released (and unlinked) it while we waited: try again
        raise DataError(self.output, f"the lock {self.path} keeps changing hands; retry")

    def _open(self) -> int:
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise DataError(os.path.dirname(self.path), f"cannot create the lock file for "
                                                        f"{self.output} here ({e.strerror}): the "
                                                        f"dataset is built beside --output; make "
                                                        f"this folder writable or choose another "
                                                        f"--output") from None

    def _still_linked(self, fd: int) -> bool:
        try:
            st, now = os.fstat(fd), os.stat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)  # while still held: a waiting taker then sees it unlinked
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
