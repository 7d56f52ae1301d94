"""Preemption outside Slurm under a real mpiexec: SIGUSR1 to ONE rank stops every rank at the same
step with a checkpoint written at that step, exit status 75; the same command resumes bit-exactly."""
import json

import pytest

from hpctrain import step_faults
from tests.conftest import losses, mpirun
from tests.helpers import PREEMPT_GPT
from tests.processes import signal_rank_midrun

pytestmark = pytest.mark.mpi

PS = ["--sync.mode=ps", "--sync.ps_servers=1"]


@pytest.mark.parametrize("mode", ["sync", "ps"])
def test_usr1_to_one_rank_stops_all_at_one_step_then_resumes(tmp_path, two_plays, mode):
    """sync: rank 1 of 2 data-parallel ranks gets the signal. ps (sync.mode = "ps", 1 worker +
    1 server, staleness 0): the signal lands on the server, which never steps: it raises the
    stop flag in its window while it waits, the worker stops at its next step. Either way: one
    stop step, a checkpoint there, exit 75, and a bit-exact resume."""
    extra = [] if mode == "sync" else [*PS, "--sync.staleness=0"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    for run in (straight, stopped):
        (tmp_path / f"{run.name}.toml").write_text(PREEMPT_GPT.format(run=run, data=two_plays))
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


def test_ps_signal_to_one_worker_stops_every_worker_at_one_step(tmp_path, two_plays):
    """2 workers (bounded staleness 1, worker 1 slowed) + 1 server: USR1 to worker 1 only; both
    workers meet at the furthest one's step, the checkpoint is written there, exit 75 on every
    rank; the same command finishes the run."""
    run = tmp_path / "ps2"
    (tmp_path / "ps2.toml").write_text(PREEMPT_GPT.format(run=run, data=two_plays))
    common, straggler = [*PS, "--sync.staleness=1"], {"delay_rank": 1, "delay_s": 0.05}
    code, err = signal_rank_midrun(3, tmp_path / "ps2.toml", run, 1, *common, faults=straggler)
    assert code == 75, err[-3000:]
    stops = [l for l in err.splitlines() if l.startswith("stopping at step")]
    assert len(stops) == 1, err[-3000:]
    s = int(stops[0].split()[3].rstrip(":"))
    assert 4 <= s < 24 and f"checkpoint: step {s} -> " in err and "Traceback" not in err
    assert max(losses(run)) == s  # worker 0 caught up to (or was at) the agreed step
    state = json.loads((run / "checkpoints" / f"step_{s:08d}" / "trainer_state.json").read_text())
    assert state["trainer"]["step"] == s

    r = mpirun(3, ["-m", "hpctrain", "train", "--config", tmp_path / "ps2.toml", *common],
               timeout=300, check=True, env=step_faults.env(**straggler))
    assert f"at step {s}" in r.stderr
    assert sorted(losses(run)) == list(range(1, 25))
