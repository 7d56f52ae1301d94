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


def rank_pid(launcher: int, rank: int) -> int:
    for pid in descendants(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in env and b"hpctrain" in cmd:
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
            try:
                if "hpctrain" in Path(f"/proc/{c}/cmdline").read_text():
                    out.append(c)
            except OSError:
                pass
    return sorted(out)


def pmi_rank(pid):
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"PMI_RANK="))


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
        pids = {pmi_rank(p): p for p in rank_pids(proc.pid)}
        assert sorted(pids) == list(range(n)), pids
        os.kill(pids[rank], signal.SIGUSR1)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err
