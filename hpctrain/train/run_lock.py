"""One job per run directory: a lease file that works on a parallel file system.

Owns `<run.dir>/.hpctrain.lock`: rank 0 creates it with O_CREAT|O_EXCL (atomic on Lustre, GPFS and
NFS v3+, unlike flock, which Lustre mounts often leave off), writes who holds it (host, pid,
Slurm job, start time) and renews its mtime every RENEW_S seconds from a daemon thread; a clean
exit (finished, preempted, failed with an error) removes it. A second job on the same run.dir is
refused with one line naming the holder. A holder that died without removing it stops renewing:
its lock is taken over after LEASE_S seconds, at once when it is an earlier run of the same Slurm
job (requeue, relaunch after a node loss) or a process on this host that no longer exists.

Collective: every rank calls `hold()`; rank 0 decides and broadcasts.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from hpctrain.errors import RunDirBusy, UserError  # noqa: F401 - re-exported

LOCK_NAME = ".hpctrain.lock"
RENEW_S = 10.0
LEASE_S = 60.0


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


def _abandoned(owner: dict, age: float, me: dict) -> str | None:
    """Why the holder's lock may be taken over, or None while it holds."""
    if age > LEASE_S:
        return f"not renewed for {age:.0f} s"
    if owner.get("job") and owner.get("job") == me["job"]:
        return f"an earlier run of Slurm job {me['job']}"
    if owner.get("host") == me["host"] and _pid_gone(owner.get("pid")):
        return f"process {owner.get('pid')} on {me['host']} has exited"
    return None


def _describe(owner: dict, age: float) -> str:
    job = f", Slurm job {owner['job']}" if owner.get("job") else ""
    return (f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}{job}, renewed {age:.0f} s ago")


def acquire(run_dir: Path, me: dict) -> tuple[bool, str]:
    """(True, note) with the lock taken (note says what was taken over, if anything), or
    (False, the holder)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path, note = run_dir / LOCK_NAME, ""
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner, age = json.loads(path.read_text() or "{}"), time.time() - path.stat().st_mtime
            except FileNotFoundError:
                continue  # released meanwhile
            except (OSError, ValueError):  # being written: judge by its age only
                owner, age = {}, time.time() - path.stat().st_mtime
            why = _abandoned(owner, age, me)
            if why is None:
                return False, _describe(owner, age)
            aside = path.with_name(f"{LOCK_NAME}.stale-{me['host']}-{me['pid']}")
            try:
                os.rename(path, aside)  # one taker wins; a loser finds the winner's fresh lock
                aside.unlink()
            except FileNotFoundError:
                pass
            note = f"took over the lock of {_describe(owner, age)} ({why})"
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(me) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return True, note
    return False, "another job keeps taking the lock"


def _release(path: Path, me: dict) -> None:
    try:
        owner = json.loads(path.read_text())
        if (owner.get("host"), owner.get("pid")) == (me["host"], me["pid"]):
            path.unlink()  # only our own: a taker may hold it now
    except (OSError, ValueError):
        pass


@contextmanager
def hold(run_dir, ctx):
    """Collective: hold the run directory's lock for the body; RunDirBusy on every rank if another
    job holds it."""
    me, path = _me(), Path(run_dir) / LOCK_NAME
    answer = None
    if ctx.rank == 0:
        try:
            ok, text = acquire(Path(run_dir), me)
            answer = ("ok" if ok else "busy", text)
        except OSError as e:
            answer = ("error", f"{e.filename or path}: cannot create the run directory's lock "
                               f"({e.strerror}); run.dir must be writable")
    status, text = ctx.comm.bcast(answer, root=0) if ctx.comm is not None else answer
    if status == "error":
        raise UserError(text)
    if status == "busy":
        raise RunDirBusy(f"{run_dir}: another job trains here ({text}); wait for it to end, cancel "
                         f"it, or use another run.dir (a dead job's lock is taken over after "
                         f"{LEASE_S:.0f} s)")
    stop = threading.Event()
    if ctx.rank == 0:
        if text:
            print(f"warning: run dir {run_dir}: {text}", file=sys.stderr, flush=True)
        threading.Thread(target=_renew, args=(path, stop), name="hpctrain-run-lock", daemon=True).start()
    try:
        yield
    finally:
        stop.set()
        if ctx.rank == 0:
            _release(path, me)


def _renew(path: Path, stop: threading.Event) -> None:
    while not stop.wait(RENEW_S):
        try:
            os.utime(path)
        except OSError:
            pass
