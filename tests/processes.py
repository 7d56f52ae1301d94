"""Training jobs as processes: start `mpiexec ... hpctrain train` in its own session and wait for
it, find its rank processes under the launcher (from /proc), and signal one rank mid-run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain import step_faults
from tests.conftest import BIN, mpiexec_path


def launch(n, cfg, *overrides, env=None, timeout=180, mpi_flags=()):
    """Start `mpiexec -n N python -m hpctrain train` in its own session; returns the Popen."""
    full_env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                    PYTHONUNBUFFERED="1")
    full_env.pop(step_faults.ENV, None)
    full_env.update(env or {})
    cmd = [mpiexec_path(), *mpi_flags, "-n", str(n), sys.executable, "-m", "hpctrain", "train",
           "--config", str(cfg), *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, start_new_session=True)


def finish(proc, timeout=180) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"launch timed out after {timeout}s:\n{out[-4000:]}")
    return proc.returncode, out


def descendants(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split():
                out += [int(child), *descendants(int(child))]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


RANK_VARS = (b"PMI_RANK", b"OMPI_COMM_WORLD_RANK", b"PMIX_RANK")  # MPICH/Hydra, Open MPI, PMIx


def python_module(pid: int) -> str | None:
    """The module a `python -m MODULE ...` process runs (None: another program, or gone). Ranks
    are found by what they run, never by a substring of the command line: the checkout's path
    may contain "hpctrain" (MPICH's .../hpctrain/.venv/bin/hydra_pmi_proxy would match)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    after = [args[i + 1] for i in range(1, len(args) - 1) if args[i] == b"-m"]
    return after[0].decode() if after else None


def launcher_rank(pid: int) -> int | None:
    """The MPI rank the launcher gave process `pid` (its environment), None if none."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in env:
        name, _, value = entry.partition(b"=")
        if name in RANK_VARS and value.isdigit():
            return int(value)
    return None


def is_rank(pid: int) -> bool:
    """Process `pid` is an hpctrain rank: `python -m hpctrain ...` with a launcher's rank."""
    return python_module(pid) == "hpctrain" and launcher_rank(pid) is not None


def rank_pid(launcher: int, rank: int) -> int:
    for pid in descendants(launcher):
        if is_rank(pid) and launcher_rank(pid) == rank:
            return pid
    raise AssertionError(f"rank {rank} not found under {launcher}")


def rank_pids(launcher_pid):
    """Python rank processes below mpiexec (mpiexec -> hydra_pmi_proxy -> ranks)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" ", 1)
            ppid = int(rest.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    out, todo = [], [launcher_pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            todo.append(c)
            if is_rank(c):
                out.append(c)
    return sorted(out)


def signal_rank_midrun(n, cfg, run, rank, *extra, faults=None):
    """Start `n` ranks (every step sleeping 0.25 s, plus the test `faults`: a dict of StepFaults
    keys), wait for 4 logged steps, SIGUSR1 to `rank` only; (exit status, stderr)."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", PYTHONUNBUFFERED="1",
               **step_faults.env(step_sleep_s=0.25, **(faults or {})))
    proc = subprocess.Popen([mpiexec_path(), "-n", str(n), sys.executable, "-m", "hpctrain", "train",
                             "--config", str(cfg), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            m = run / "metrics.jsonl"
            if m.exists() and len(m.read_text().splitlines()) >= 4:
                break
            time.sleep(0.2)
        pids = {launcher_rank(p): p for p in rank_pids(proc.pid)}
        assert sorted(pids) == list(range(n)), pids
        os.kill(pids[rank], signal.SIGUSR1)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err
