"""`hpctrain tune search` outside Slurm, trials trained under a real `mpiexec -n 2`: a worker
stopped by USR1 mid-trial exits 75 and leaves its trial RUNNING and claimed; run again, it resumes
that trial from its checkpoint (same number, same values) and finishes it; a hopeless trial is
pruned with a committed checkpoint; a trial whose training crashes is FAIL and the study goes on;
`tune status` gives the best configuration as a training TOML."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from hpctrain import config
from tests.conftest import BIN, ROOT, mpiexec_path, run_cmd
from tests.slurm.conftest import last_step, losses
from tests.tune_setup import STEPS, make_dataset, trials, write_study

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("tune-data") / "d")


def start_worker(cfg):
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "hpctrain", "tune", "search", str(cfg), "--launch",
                             f"{mpiexec_path()} -n 2", "--worker", "w0"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout=240):
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out


def test_preempted_worker_resumes_its_trial_and_prunes_and_fails_others(tmp_path, data):
    # trial 0 learns (stopped once, resumed), trial 1 barely moves (pruned by the median of trial
    # 0 at step 4), trial 2's training crashes at step 3 (a NaN with train.max_bad_steps = 1)
    cfg, tune = write_study(tmp_path, data, [(3e-3, 0), (1e-6, 0), (3e-3, 3)], pruner="median",
                            sleep=0.15)
    run0 = tune.trial_dir(0)
    proc = start_worker(cfg)
    deadline = time.monotonic() + 120
    while last_step(run0) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    rc, out = finish(proc)
    assert rc == 75, out
    assert json.loads((tune.study_dir / "workers" / "w0.json").read_text())["trial"] == 0
    assert [(t.number, t.state.name) for t in trials(tune)] == [
        (0, "RUNNING"), (1, "WAITING"), (2, "WAITING")], out  # 1 and 2: enqueued, not started
    stopped = last_step(run0)
    assert 4 <= stopped < STEPS and (run0 / "checkpoints" / f"step_{stopped:08d}" / "COMMIT.json").is_file()

    rc, out = finish(start_worker(cfg))
    assert rc == 0, out
    assert "worker w0: resuming its trial 0" in out
    done = trials(tune)
    assert [(t.number, t.state.name) for t in done] == [(0, "COMPLETE"), (1, "PRUNED"), (2, "FAIL")], out
    t0, t1, t2 = done
    assert (t0.params["train.lr"], t0.user_attrs["launches"], t0.user_attrs["steps"]) == (3e-3, 2, STEPS)
    assert sorted(losses(run0)) == list(range(1, STEPS + 1))  # every step once across the stop
    assert re.search(rf"resumed from \S+step_0*{stopped} at step {stopped}\b",
                     (run0 / "train.log").read_text())
    assert t0.value == t0.intermediate_values[STEPS]
    assert sorted(t1.intermediate_values)[0] == 4 and t1.user_attrs["steps"] < STEPS
    s1 = t1.user_attrs["steps"]
    assert (tune.trial_dir(1) / "checkpoints" / f"step_{s1:08d}" / "COMMIT.json").is_file()
    assert t2.user_attrs["steps"] < 3 and "exit status" in t2.user_attrs["error"]
    assert not list((tune.study_dir / "workers").iterdir())

    best = tmp_path / "best.toml"
    r = run_cmd([sys.executable, "-m", "hpctrain", "tune", "status", tune.journal, "--toml", best],
                check=True)
    rows = re.findall(r"^\s+(\d+)\s+(\w+)\s+(\S+)\s+(\d+)\s", r.stdout, re.M)
    assert [(int(n), s, int(steps)) for n, s, _, steps in rows] == [
        (0, "COMPLETE", STEPS), (1, "PRUNED", s1), (2, "FAIL", t2.user_attrs["steps"])], r.stdout
    got = config.load(best)
    assert (got.train.lr, got.debug.inject_nan_at_step) == (3e-3, 0)
