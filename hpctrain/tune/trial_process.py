"""A trial's training process: it cannot outlive its worker, and one left by a killed worker is ended.

Owns: starting the trial's command in a session of its own with PR_SET_PDEATHSIG = SIGTERM (Linux
prctl through ctypes), so that when the worker dies, SIGKILL included, the kernel sends the training
(or its launcher: mpiexec passes TERM on to every rank, and its proxies end the ranks when mpiexec
itself is killed) the preemption signal: it commits a checkpoint at the next step and exits 75; the
trial's marker in the child's environment (HPCTRAIN_TUNE_TRIAL = its run directory), which the
launcher passes on to every rank, by which a later worker proves that a process on this host is
this trial's training; and, before a (re)launch, ending such an orphan (USR1, the preemption
signal, to the rank holding the run lock; SIGKILL to every marked process left after a grace), so
that the relaunch resumes the trial instead of being refused by the run lock. It must never
decide a trial's outcome (trial_run.py).
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hpctrain import logs

log = logs.get_logger(__name__)
MARKER_ENV = "HPCTRAIN_TUNE_TRIAL"
PR_SET_PDEATHSIG = 1
ORPHAN_GRACE_S = 90.0  # a stopped training commits its checkpoint at the next step, then exits
RUN_LOCK = ".hpctrain.lock"  # hpctrain/distributed/run_lock.py: rank 0's host and pid, as JSON


def _die_with_parent(parent: int):
    def preexec() -> None:  # in the child, between fork and exec
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the worker died before the prctl: do not start at all
            os._exit(1)
    return preexec


def start(args: list[str], log, trial_marker: str) -> subprocess.Popen:
    """The trial's command, writing to `log`, in its own session, signalled TERM when we die."""
    kwargs = {}
    if sys.platform.startswith("linux"):
        kwargs["preexec_fn"] = _die_with_parent(os.getpid())
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, MARKER_ENV: trial_marker},
                            **kwargs)


def _alive(pid: int) -> bool:
    """Running (a zombie, killed and not yet reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def marked_processes(trial_marker: str) -> list[int]:
    """Every live process of ours on this host that carries the trial's marker: a launcher, its
    proxies and the ranks of this trial's training (never another trial's: each has its own)."""
    want, found = f"{MARKER_ENV}={trial_marker}".encode(), []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or another user's
            continue
        if want in env and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _lock_holder(run_dir: Path) -> int | None:
    """The pid holding run_dir's run lock on this host (rank 0 of its training), or None."""
    try:
        owner = json.loads((run_dir / RUN_LOCK).read_text())
        return int(owner["pid"]) if owner["host"] == socket.gethostname() else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _wait_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def end_orphan(run_dir: Path, trial_marker: str, grace_s: float = ORPHAN_GRACE_S) -> None:
    """A previous worker's training of this trial still runs here (its launcher did not pass the
    parent-death TERM on, or it is still committing its checkpoint): stop it the preemption way
    (USR1 to the rank holding the run lock: every rank stops at the same step, with a checkpoint)
    and SIGKILL whatever of it is left after `grace_s`, so that the relaunch resumes the trial."""
    orphans = marked_processes(trial_marker)
    if not orphans:
        return
    holder = _lock_holder(run_dir)
    log.info(f"[tune] {run_dir}: the training of a previous worker (pids {orphans}) still runs: "
             f"stopping it (USR1 to pid {holder}: checkpoint and exit), then resuming from its "
             f"checkpoint")
    if holder in orphans:
        os.kill(holder, signal.SIGUSR1)
    if _wait_gone(orphans, grace_s if holder in orphans else 10.0):
        return
    left = [p for p in orphans if _alive(p)]
    log.info(f"[tune] {run_dir}: pids {left} did not stop within {grace_s:g} s: killing them")
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _wait_gone(left, 30.0)
