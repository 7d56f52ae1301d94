"""`hpctrain tune search` outside Slurm, trials trained under a real `mpiexec -n 2`: a worker
stopped by USR1 mid-trial exits 75 and leaves its trial RUNNING and claimed; run again, it resumes
that trial from its checkpoint (same number, same values) and finishes it; a hopeless trial is
pruned with a committed checkpoint; a trial whose training crashes is FAIL and the study goes on;
`tune status` gives the best configuration as a training TOML."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain import config
from hpctrain.tune import trial_process
from tests.conftest import BIN, ROOT, mpiexec_path, run_cmd
from tests.slurm.conftest import last_step, losses
from tests.tune_setup import STEPS, make_dataset, trials, worker_faults, write_study

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("tune-data") / "d")


def start_worker(cfg, faults):
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1",
               **faults)
    return subprocess.Popen([sys.executable, "-m", "hpctrain", "tune", "search", str(cfg), "--launch",
                             f"{shlex.quote(mpiexec_path())} -n 2", "--worker", "w0"], cwd=ROOT, env=env,
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
    cfg, tune = write_study(tmp_path, data, [3e-3, 1e-6, 3e-3], pruner="median")
    faults = worker_faults(0.15, failing=2)
    run0 = tune.trial_dir(0)
    proc = start_worker(cfg, faults)
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

    rc, out = finish(start_worker(cfg, faults))
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
    assert config.load(best).train.lr == 3e-3


def test_a_killed_workers_training_ends_and_a_restarted_worker_finishes_the_trial(tmp_path, data):
    """SIGKILL the worker mid-trial: its training (mpiexec and both ranks) ends within seconds,
    by itself (the kernel's parent-death signal: checkpoint and exit); the restarted worker
    resumes the trial from that checkpoint to its full steps (#30: the orphan trained on and the
    restarted worker's relaunch was refused by the run lock, trial FAIL at 24 of 60 steps)."""
    cfg, tune = write_study(tmp_path, data, [3e-3])
    faults = worker_faults(1.0)  # 16 steps: >= 16 s
    run0 = tune.trial_dir(0)
    proc = start_worker(cfg, faults)
    deadline = time.monotonic() + 120
    while last_step(run0) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    rank0 = json.loads((run0 / ".hpctrain.lock").read_text())["pid"]
    launched = trial_process.marked_processes(str(run0))
    beacons = [p for p in launched if b"BEACON_SRC" in Path(f"/proc/{p}/cmdline").read_bytes()]
    # mpiexec, its proxy, 2 ranks, and each rank's liveness beacon (hpctrain/distributed/beacon.py)
    assert rank0 in launched and len(launched) == 6 and len(beacons) == 2, launched
    proc.kill()
    finish(proc)
    t_kill = time.monotonic()
    while trial_process.marked_processes(str(run0)) and time.monotonic() - t_kill < 30:
        time.sleep(0.1)
    gone_after = time.monotonic() - t_kill
    stopped = last_step(run0)
    # an orphan would train >= 12 s more (13.7 s measured without the fix)
    assert trial_process.marked_processes(str(run0)) == [] and gone_after < 8, gone_after
    assert 3 <= stopped <= 6 and (run0 / "checkpoints" / f"step_{stopped:08d}" / "COMMIT.json").is_file()

    rc, out = finish(start_worker(cfg, {}))  # the resumed trial needs no slow steps
    assert rc == 0, out
    (t0,) = trials(tune)
    assert (t0.state.name, t0.user_attrs["steps"], t0.user_attrs["launches"]) == ("COMPLETE", STEPS, 2)
    assert sorted(losses(run0)) == list(range(1, STEPS + 1))  # resumed: every step once


def test_a_restarted_worker_stops_a_live_orphan_of_its_trial_and_resumes(tmp_path, data):
    """Trial 0 RUNNING, claimed by w0, whose process is gone, and its training still running under
    mpiexec holding the run-directory lock (as a worker of an older version, without the parent-
    death signal, left it): the restarted worker proves it is this trial's (the marker), stops it
    with USR1 (checkpoint and exit), and resumes the trial to its end instead of being refused by
    the run lock and recording FAIL."""
    from hpctrain.tune.study import ask_new, open_study

    cfg, tune = write_study(tmp_path, data, [3e-3])
    faults = worker_faults(0.5)
    run0, trial = tune.trial_dir(0), ask_new(open_study(tune), tune)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tune.study_dir / "workers").mkdir()
    (tune.study_dir / "workers" / "w0.json").write_text(json.dumps(
        {"trial": 0, "worker": "w0", "host": socket.gethostname(), "pid": int(gone)}))
    orphan = subprocess.Popen([mpiexec_path(), "-n", "2", *trial_process_command(cfg, trial, run0)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=dict(os.environ, **faults, **{trial_process.MARKER_ENV: str(run0)}),
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while last_step(run0) < 2 and orphan.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        rank0 = json.loads((run0 / ".hpctrain.lock").read_text())["pid"]
        rc, out = finish(start_worker(cfg, {}))  # its own relaunch of the trial: no slow steps
        assert orphan.wait(timeout=30) == 75  # stopped with a checkpoint, not killed
    finally:
        if orphan.poll() is None:
            os.killpg(orphan.pid, signal.SIGKILL)
            orphan.wait()
    assert rc == 0, out
    assert f"still runs: stopping it (USR1 to pid {rank0}" in out and "killing" not in out, out
    (t0,) = trials(tune)
    assert (t0.state.name, t0.user_attrs["steps"]) == ("COMPLETE", STEPS), out
    # from the checkpoint the USR1 stop wrote (checkpoint.interval is 1000): at the step boundary
    # after the orphan's step 2 or later, before its end
    assert re.search(r"resumed from \S+step_0*([2-9]|1[0-5]) at step", (run0 / "train.log").read_text())
    assert sorted(losses(run0)) == list(range(1, STEPS + 1))


def trial_process_command(cfg, trial, run_dir):
    from hpctrain.tune.trial_run import Launch

    launch = Launch([], str(cfg), [])
    return launch.command(launch.train_overrides(trial.params, run_dir))


def test_a_torn_completion_record_is_told_again_on_the_next_run(tmp_path, data):
    """#47: the worker killed while appending trial 0's completion (the journal's last record cut
    mid-line): the trial read RUNNING, its claim already dropped, and every later `tune search`
    said 'done' with it RUNNING for ever. Now the next worker takes it over (no claim, its training
    ended), resumes it from its final checkpoint, which ends at once, and tells the same value."""
    cfg, tune = write_study(tmp_path, data, [3e-3])
    rc, out = finish(start_worker(cfg, {}))
    assert rc == 0, out
    (t0,) = trials(tune)
    assert t0.state.name == "COMPLETE", out
    journal = Path(tune.journal)
    data_ = journal.read_bytes()
    last = data_.rstrip(b"\n").rfind(b"\n") + 1
    record = json.loads(data_[last:])
    assert record["op_code"] == 6 and record["state"] == 1, record  # SET_TRIAL_STATE_VALUES: COMPLETE
    journal.write_bytes(data_[:last + len(data_[last:]) // 2])  # torn mid-append
    assert [t.state.name for t in trials(tune)] == ["RUNNING"]
    assert not list((tune.study_dir / "workers").glob("*.json"))  # dropped after the tell

    rc, out = finish(start_worker(cfg, {}))
    assert rc == 0, out
    assert "taking over trial 0, still RUNNING: no worker claims it" in out, out
    (again,) = trials(tune)
    assert (again.state.name, again.value, again.user_attrs["steps"]) == ("COMPLETE", t0.value, STEPS), out
    assert again.user_attrs["launches"] == 2
    run0 = tune.trial_dir(0)
    assert sorted(losses(run0)) == list(range(1, STEPS + 1))  # no step trained twice
    assert re.search(rf"resumed from \S+step_0*{STEPS} at step {STEPS}\b", (run0 / "train.log").read_text())
