"""Preemption outside Slurm under a real mpiexec: SIGUSR1 to ONE rank stops every rank at the same
step with a checkpoint written at that step, exit status 75; the same command resumes bit-exactly."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import BIN, TINY_SECTIONS, mpiexec_path, mpirun, run_cmd

pytestmark = pytest.mark.mpi

CFG = TINY_SECTIONS + """[train]
steps = 24
micro_batch_size = 2
warmup_steps = 2
eval_interval = 0
log_interval = 100
[checkpoint]
interval = 1000
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from data_tools.corpora import shakespeare_files

    out = tmp_path_factory.mktemp("pdata") / "d"
    run_cmd([sys.executable, "-m", "data_tools", "shard", "--input", *sorted(shakespeare_files())[:2],
             "--output", out, "--tokenizer", "bytes", "--val-fraction", "0", "--no-progress"],
            timeout=120, check=True)
    return out


def losses(run):
    recs = [json.loads(l) for l in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


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


def signal_rank_midrun(n, cfg, run, rank, *extra):
    """Start `n` ranks, wait for 4 logged steps, SIGUSR1 to `rank` only; (exit status, stderr)."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([mpiexec_path(), "-n", str(n), sys.executable, "-m", "hpctrain", "train",
                             "--config", str(cfg), "--debug.step_sleep_s=0.25", *extra],
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


PS = ["--sync.mode=ps", "--sync.ps_servers=1"]


@pytest.mark.parametrize("mode", ["sync", "ps"])
def test_usr1_to_one_rank_stops_all_at_one_step_then_resumes(tmp_path, data, mode):
    """sync: rank 1 of 2 data-parallel ranks gets the signal. ps (sync.mode = "ps", 1 worker +
    1 server, staleness 0): the signal lands on the server, which never steps: it raises the
    stop flag in its window while it waits, the worker stops at its next step. Either way: one
    stop step, a checkpoint there, exit 75, and a bit-exact resume."""
    extra = [] if mode == "sync" else [*PS, "--sync.staleness=0"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    for run in (straight, stopped):
        (tmp_path / f"{run.name}.toml").write_text(CFG.format(run=run, data=data))
    mpirun(2, ["-m", "hpctrain", "train", "--config", tmp_path / "straight.toml", *extra],
           timeout=300, check=True)

    code, err = signal_rank_midrun(2, tmp_path / "stopped.toml", stopped, 1, *extra)
    assert code == 75, err[-3000:]
    line = next(l for l in err.splitlines() if l.startswith("stopping at step"))
    s = int(line.split()[3].rstrip(":"))
    assert 4 <= s < 24 and "signal on another rank" in line, line
    assert f"checkpoint: step {s} -> " in err
    assert "not requeued (not running inside a Slurm job)" in err and "Traceback" not in err
    assert max(losses(stopped)) == s

    r = mpirun(2, ["-m", "hpctrain", "train", "--config", tmp_path / "stopped.toml", *extra],
               timeout=300, check=True)
    assert f"at step {s}" in r.stderr
    a, b = losses(straight), losses(stopped)
    assert sorted(b) == list(range(1, 25)) and all(a[k] == b[k] for k in a), (a, b)


def test_ps_signal_to_one_worker_stops_every_worker_at_one_step(tmp_path, data):
    """2 workers (bounded staleness 1, worker 1 slowed) + 1 server: USR1 to worker 1 only; both
    workers meet at the furthest one's step, the checkpoint is written there, exit 75 on every
    rank; the same command finishes the run."""
    run = tmp_path / "ps2"
    (tmp_path / "ps2.toml").write_text(CFG.format(run=run, data=data))
    common = [*PS, "--sync.staleness=1", "--debug.delay_rank=1", "--debug.delay_s=0.05"]
    code, err = signal_rank_midrun(3, tmp_path / "ps2.toml", run, 1, *common)
    assert code == 75, err[-3000:]
    stops = [l for l in err.splitlines() if l.startswith("stopping at step")]
    assert len(stops) == 1, err[-3000:]
    s = int(stops[0].split()[3].rstrip(":"))
    assert 4 <= s < 24 and f"checkpoint: step {s} -> " in err and "Traceback" not in err
    assert max(losses(run)) == s  # worker 0 caught up to (or was at) the agreed step
    state = json.loads((run / "checkpoints" / f"step_{s:08d}" / "trainer_state.json").read_text())
    assert state["trainer"]["step"] == s

    r = mpirun(3, ["-m", "hpctrain", "train", "--config", tmp_path / "ps2.toml", *common],
               timeout=300, check=True)
    assert f"at step {s}" in r.stderr
    assert sorted(losses(run)) == list(range(1, 25))
