"""One job per run directory: a lease file that works on a parallel file system.

Owns `<run.dir>/.hpctrain.lock` and the check that this process still holds it. Rank 0 writes who
it is (host, pid, Slurm job, start time) into a private temp file, fsyncs it and hard-links it to
the lock name, which fails when the name exists (atomic on Lustre, GPFS and NFS v3+, unlike flock,
which Lustre mounts often leave off): a full disk leaves no lock behind, and a lock file is never
seen half written. Rank 0 keeps the file open and renews its mtime every `renew_s()` seconds from a
daemon thread; a clean exit (finished, preempted, failed with an error) removes it. A second job on
the same run.dir is refused with one line naming the holder. A holder that died without removing
it stops renewing: its lock is taken over after `lease_s()` seconds (HPCTRAIN_RUN_LOCK_LEASE_S,
default 300), at once when it is an earlier run of the same Slurm job (requeue, relaunch after a node
loss), a process on this host that no longer exists, or an empty/garbled file (an older version
interrupted while creating it).

A holder that was only frozen (SIGSTOP, `scontrol suspend`) longer than the lease finds on waking
that the lock is another job's: `assert_held()` (called by the renewal thread, before every metrics
write and before a checkpoint's tmp dir, commit and retention) then ends the whole job at once with
one line naming the lock and its new holder, before it writes anything more. Every rank keeps the
lock's bytes as rank 0 wrote them (the fence): `taken_over()` tells a rank of any number that wakes
after a newer launch took the run dir over (its watchdog then writes no forensics there), and
`stop_if_taken_over()`, called right before every file a rank creates, renames or removes in a
checkpoint (its share, the node-layout file, rank 0's JSON files and commit), ends such a rank
before it writes; `launch_id()` makes a save's tmp dir this launch's own.

Collective: every rank calls `hold()`; rank 0 decides and broadcasts.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from hpctrain import logs
from hpctrain.errors import RunDirBusy, UserError  # noqa: F401 - re-exported

LOCK_NAME = ".hpctrain.lock"
RENEW_S = 10.0
LEASE_ENV = "HPCTRAIN_RUN_LOCK_LEASE_S"
DEFAULT_LEASE_S = 300.0


class RunLockLost(UserError):
    """Another job took this job's run-directory lock over (this one was frozen past the lease)."""


def lease_s() -> float:
    """Seconds without renewal after which a lock counts as abandoned (HPCTRAIN_RUN_LOCK_LEASE_S)."""
    raw = os.environ.get(LEASE_ENV, "").strip()
    if not raw:
        return DEFAULT_LEASE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UserError(f"environment variable {LEASE_ENV}={raw!r}: must be a number of seconds > 0 "
                        f"(default {DEFAULT_LEASE_S:.0f})")
    return value


def renew_s() -> float:
    return min(RENEW_S, lease_s() / 6)


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID"),
            "restart": os.environ.get("SLURM_RESTART_COUNT", "0"), "started": time.time()}


def _pid_gone(pid) -> bool:
    """True when the process has exited: no such pid, or a zombie (killed, not yet reaped by its
    parent; a SIGKILLed rank whose launcher died too may stay one for a while)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, TypeError, ValueError):
        return False
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


def _abandoned(owner: dict | None, age: float, me: dict) -> str | None:
    """Why the holder's lock may be taken over, or None while it holds."""
    if owner is None:
        return "an empty or unreadable lock file, left by an interrupted creation"
    if age > lease_s():
        return f"not renewed for {age:.0f} s"
    if owner.get("job") and owner.get("job") == me["job"]:
        return f"an earlier run of Slurm job {me['job']}"
    if owner.get("host") == me["host"] and _pid_gone(owner.get("pid")):
        return f"process {owner.get('pid')} on {me['host']} has exited"
    return None


def _describe(owner: dict | None, age: float) -> str:
    owner = owner or {}
    job = f", Slurm job {owner['job']}" if owner.get("job") else ""
    return f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}{job}, renewed {age:.0f} s ago"


def _read_lock(path: Path) -> tuple[dict | None, float, tuple[int, int]]:
    """(holder or None when empty/garbled, age in s, file identity) of the lock file as it is now;
    FileNotFoundError when there is none."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        raw = f.read(65536)
    try:
        owner = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        owner = None
    return (owner if isinstance(owner, dict) else None), time.time() - st.st_mtime, (st.st_dev, st.st_ino)


def holder_gone(run_dir) -> str | None:
    """Why no live job holds `run_dir`'s lock (none there: its job ended cleanly, or the reason a
    new job would take it over: a process gone, a lease run out), or None while one may hold it.
    For a tool deciding that the training of a run dir has ended (hpctrain/tune/study.py)."""
    try:
        owner, age, _ = _read_lock(Path(run_dir) / LOCK_NAME)
    except FileNotFoundError:
        return "no run lock"
    except OSError:
        return None
    return _abandoned(owner, age, _me())


def _identity(path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


class Lease:
    """The lock this process holds: the open lock file, and where it should be."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd
        st = os.fstat(fd)
        self.ident = (st.st_dev, st.st_ino)
        self.released = False
        self._mutex = threading.Lock()  # a check never sees our own release as a loss

    def lost(self) -> str | None:
        """Who holds the lock now if not us; None while we do (or the file system cannot tell)."""
        with self._mutex:
            if self.released:
                return None
            try:
                if _identity(self.path) == self.ident:
                    return None  # the common case: one stat
                owner, age, ident = _read_lock(self.path)
            except FileNotFoundError:
                return "the lock file was removed"
            except OSError:
                return None  # a transient error reading it says nothing about who holds it
        if ident == self.ident:
            return None
        return f"it is now held by {_describe(owner, age)}"

    def renew(self) -> None:
        with self._mutex:
            if self.released:
                return
            try:
                os.utime(self.fd)  # our own file, never a new holder's under the same name
            except OSError:
                pass

    def release(self) -> None:
        with self._mutex:
            self.released = True
            try:
                if _identity(self.path) == self.ident:
                    self.path.unlink()  # only our own: a taker may hold it now
            except OSError:
                pass
            os.close(self.fd)


def _write_candidate(path: Path, me: dict) -> tuple[Path, int]:
    """A complete, fsynced lock file under a private name, and its open descriptor (nothing is left
    behind when it cannot be written)."""
    tmp = path.with_name(f"{LOCK_NAME}.{me['host']}.{me['pid']}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
    try:
        data = (json.dumps(me) + "\n").encode()
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return tmp, fd


def _take_over(path: Path, judged: tuple[int, int], me: dict) -> None:
    """Move the abandoned lock `judged` out of the way; if another taker replaced it meanwhile,
    put theirs back."""
    aside = path.with_name(f"{LOCK_NAME}.stale-{me['host']}-{me['pid']}")
    try:
        os.rename(path, aside)  # one taker wins; a loser finds the winner's fresh lock
    except FileNotFoundError:
        return
    if _identity(aside) != judged:
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    aside.unlink(missing_ok=True)


def acquire(run_dir: Path, me: dict) -> tuple[Lease | None, str]:
    """(the lease, note) with the lock taken (note says what was taken over, if anything), or
    (None, the holder)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path, note = run_dir / LOCK_NAME, ""
    try:
        tmp, fd = _write_candidate(path, me)
    except OSError as e:  # name the lock, not the private temp file (which is gone)
        raise OSError(e.errno, e.strerror, str(path)) from e
    st, lease = os.fstat(fd), None
    mine = (st.st_dev, st.st_ino)
    try:
        for _ in range(3):
            try:
                os.link(tmp, path)
            except FileExistsError:
                try:
                    owner, age, ident = _read_lock(path)
                except FileNotFoundError:
                    continue  # released meanwhile
                if ident == mine:  # the link went through (an NFS retry reported EEXIST)
                    lease = Lease(path, fd)
                    return lease, note
                why = _abandoned(owner, age, me)
                if why is None:
                    return None, _describe(owner, age)
                _take_over(path, ident, me)
                note = f"took over the lock of {_describe(owner, age)} ({why})"
                continue
            lease = Lease(path, fd)
            return lease, note
        return None, "another job keeps taking the lock"
    finally:
        tmp.unlink(missing_ok=True)
        if lease is None:
            os.close(fd)


_held: Lease | None = None
_stopping = threading.Lock()
_fence: tuple[Path, bytes] | None = None  # every rank: (the lock, the bytes this launch's rank 0 wrote)


def fence() -> tuple[str, str] | None:
    """(sha256 of this launch's lock file, its path) while `hold()` holds, for the beacon (stdlib only)."""
    held = _fence
    return (hashlib.sha256(held[1]).hexdigest(), os.fspath(held[0])) if held is not None else None


def taken_over() -> str | None:
    """Who holds this launch's run-directory lock now when a NEWER launch took it over (this rank
    was frozen past its job's relaunch: SIGSTOP, a suspended node), else None (ours, gone after a
    clean end, unreadable, or no lock held). Any rank may ask: the lock is on the shared run dir.
    A stale rank writes nothing more into the run dir then (forensics: hpctrain/distributed/watchdog.py)."""
    held = _fence
    if held is None:
        return None
    try:
        with open(held[0], "rb") as f:
            if f.read(65536) == held[1]:
                return None
        owner, age, _ = _read_lock(held[0])
    except OSError:
        return None
    return f"{held[0]} is held by {_describe(owner, age)}"


def launch_id() -> str | None:
    """A short id of this launch (the same on every rank: from the lock's bytes its rank 0 wrote,
    which name its host, pid and start time), for names no other launch may use (a checkpoint's tmp
    dir); None where no lock is held (tools, tests without a run dir)."""
    held = fence()
    return held[0][:12] if held is not None else None


def stop_if_taken_over(path) -> None:
    """Right before a rank of any number creates, renames or removes `path` in the run dir: end this
    process at once (one line, exit 2; no MPI Abort: its launch is gone) if a newer launch took the
    run dir over (`taken_over()`: this rank was frozen past its job's relaunch), so that it writes
    nothing into a run dir the newer launch owns. A no-op while the lock is ours or none is held."""
    why = taken_over()
    if why is None:
        return
    logs.error(f"error: {path}: not written: {why}: a newer launch owns the run dir and this rank "
               f"of an older one was frozen past its relaunch; ending this stale rank")
    os._exit(2)  # abort.EXIT_USER_ERROR


def assert_held() -> None:
    """End the whole job at once (one line, exit 2) if this process held the run-directory lock and
    another job has it now; nothing else may be written then. A no-op where no lock is held (ranks
    other than 0, tools)."""
    lease = _held
    why = lease.lost() if lease is not None else None
    if why is None:
        return
    if not _stopping.acquire(blocking=False):
        threading.Event().wait()  # another thread is ending the job
    from hpctrain.distributed.abort import stop_job

    stop_job(RunLockLost(
        f"{lease.path}: this job lost its run-directory lock ({why}), probably after being "
        f"suspended or stopped for more than {lease_s():.0f} s ({LEASE_ENV}); stopping at once "
        f"without saving a checkpoint or writing metrics: the other job owns {lease.path.parent} now"))


@contextmanager
def hold(run_dir, ctx, job=None):
    """Collective: hold the run directory's lock for the body; RunDirBusy on every rank if another
    job holds it. `job`: the whole job's communicator where `ctx` is one part of it (a PBT member,
    each with its own run dir; collective over `job` then): what was taken over is said once."""
    global _held, _fence
    me, path = _me(), Path(run_dir) / LOCK_NAME
    answer, lease = None, None
    if ctx.rank == 0:
        try:
            lease, text = acquire(Path(run_dir), me)
            answer = ("ok" if lease else "busy", text, json.dumps(me) + "\n")  # the lock's bytes
        except OSError as e:
            answer = ("error", f"{e.filename or path}: cannot create the run directory's lock ({e.strerror}); run.dir "
                               f"must be writable and have free space", "")
        except UserError as e:
            answer = ("error", str(e), "")
    status, text, written = ctx.comm.bcast(answer, root=0) if ctx.comm is not None else answer
    _say_taken_over(f"run dir {run_dir}: {text}" if status == "ok" and text and ctx.rank == 0 else None, job)
    if status == "error":
        raise UserError(text)
    if status == "busy":
        raise RunDirBusy(f"{run_dir}: another job trains here ({text}); wait for it to end, cancel "
                         f"it, or use another run.dir (a dead job's lock is taken over after "
                         f"{lease_s():.0f} s)")
    stop = threading.Event()
    _fence = (path, written.encode())
    if lease is not None:
        _held = lease
        threading.Thread(target=_renew, args=(lease, stop), name="hpctrain-run-lock", daemon=True).start()
    try:
        yield
    finally:
        stop.set()
        _fence = None
        if lease is not None:
            _held = None
            lease.release()


def _say_taken_over(note: str | None, job) -> None:
    """One warning line per job for the locks it took over from holders that are gone: rank 0's
    own (`note`), or with `job` every part's, gathered to the job's rank 0 (a PBT population of
    N one-rank members printed N lines, one per rank)."""
    notes = [note] if job is None else job.gather(note, root=0)
    notes = [n for n in notes or () if n]
    if notes:
        logs.warning("warning: " + "; ".join(notes))


def _renew(lease: Lease, stop: threading.Event) -> None:
    every = renew_s()
    while not stop.wait(every):
        assert_held()
        lease.renew()
