"""Lock files on the shared file system for the study: one holder at a time, and a holder that
was killed does not block the others for ever.

Owns: taking a lock by creating its file exclusively (O_CREAT | O_EXCL: atomic on NFSv3+ and
Lustre, where flock is often off), releasing it, and taking over a lock file older than its
stale limit (its holder was killed while holding it). Two locks use it: the ask lock (study.py,
held while a trial is created) and the journal's own append lock, `<journal>.lock`, the same file
Optuna's JournalFileSymlinkLock takes, so optuna-dashboard and other Optuna processes on the
journal still exclude us and we them. It must never know what the lock protects.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from pathlib import Path

ASK_STALE_S = 120.0      # creating a trial takes well under a second
JOURNAL_STALE_S = 300.0  # one append: milliseconds, unless the file system stalls for minutes


def acquire(lock: Path, stale_s: float) -> None:
    """Block until this process holds `lock`."""
    wait = 0.001
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            _take_over_if_stale(lock, stale_s)
            time.sleep(wait)
            wait = min(wait * 2, 0.5)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()}\n")
        return


def release(lock: Path) -> None:
    with contextlib.suppress(FileNotFoundError):  # taken over as stale meanwhile
        os.unlink(lock)


@contextlib.contextmanager
def held(lock: Path, stale_s: float):
    acquire(lock, stale_s)
    try:
        yield
    finally:
        release(lock)


def _take_over_if_stale(lock: Path, stale_s: float) -> None:
    try:
        if time.time() - os.lstat(lock).st_mtime < stale_s:  # lstat: Optuna's lock is a symlink
            return
        aside = lock.with_name(f"{lock.name}.{uuid.uuid4().hex}.stale")
        os.rename(lock, aside)  # of several processes taking it over, one wins the rename
        os.unlink(aside)
    except FileNotFoundError:
        pass


class JournalLock:
    """The lock object JournalFileBackend takes around every read-modify-append of the journal
    (Optuna's BaseJournalFileLock interface: acquire() -> True, release())."""

    def __init__(self, journal: str | Path, stale_s: float = JOURNAL_STALE_S):
        self.lock = Path(f"{journal}.lock")
        self.stale_s = stale_s

    def acquire(self) -> bool:
        acquire(self.lock, self.stale_s)
        return True

    def release(self) -> None:
        release(self.lock)
