"""slurm/tune.sbatch on the local Slurm cluster. Two array tasks are two search workers sharing one
study; the task that carries the array's own job id is preempted mid-trial (`scancel
--signal=USR1 --batch <array>_<task>`) while the other trains: only that task is requeued, and it
resumes the same trial from its checkpoint; a trial whose training crashes is FAIL and the study
goes on. A task stopped without requeue leaves its trial to the next array submitted. Trials train
under `srun --mpi=pmi2`, one job step each."""
from __future__ import annotations

import json
import re

import pytest

from tests.conftest import ROOT
from tests.slurm.conftest import last_step, losses
from tests.tune_setup import STEPS, make_dataset, trials, worker_faults, write_study

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# train.lr of trials 0..4; trial FAILING crashes at step 3 (a test fault in the array's environment)
POINTS = [3e-3, 1e-3, 3e-3, 2e-3, 5e-3]
FAILING = 2


def claimed(tune, worker: str):
    path = tune.study_dir / "workers" / f"{worker}.json"
    try:
        return json.loads(path.read_text())["trial"]
    except (FileNotFoundError, ValueError):
        return None


def test_array_tasks_share_a_study_and_a_preempted_task_resumes_its_trial(jobs, tmp_path):
    data = make_dataset(tmp_path / "data")
    cfg, tune = write_study(tmp_path, data, POINTS)
    jid = jobs.sbatch(f"--output={tmp_path}/tune-%A_%a.out", "--chdir", tmp_path, "--array=0-1",
                      ROOT / "slurm" / "tune.sbatch", cfg, env=worker_faults(0.2, failing=FAILING))
    jobs.wait_for(lambda: [r.get("JobState") for r in jobs.show(jid)] == ["RUNNING"] * 2,
                  "both tasks running", job_id=jid)
    # the task whose own job id is the array's: `scontrol requeue <its SLURM_JOB_ID>` would
    # requeue the whole array
    (carrier,) = [r["ArrayTaskId"] for r in jobs.show(jid) if r["JobId"] == jid]
    other = "1" if carrier == "0" else "0"
    me = f"{jid}_{carrier}"

    def mid_trial():
        n = claimed(tune, me)
        return n is not None and n != FAILING and last_step(tune.trial_dir(n)) >= 4

    jobs.wait_for(mid_trial, f"task {me} 4 steps into a trial", timeout=180, job_id=jid)
    preempted = claimed(tune, me)
    assert jobs.show(f"{jid}_{other}")[0]["JobState"] == "RUNNING"  # the other one trains on
    jobs.scancel("--signal=USR1", "--batch", me)
    recs = {r["ArrayTaskId"]: r for r in jobs.wait(jid, timeout=300, n_records=2)}
    logs = {t: (tmp_path / f"tune-{jid}_{t}.out").read_text() for t in (carrier, other)}
    assert {t: (r["JobState"], r["Restarts"]) for t, r in recs.items()} == {
        carrier: ("COMPLETED", "1"), other: ("COMPLETED", "0")}, logs

    done = trials(tune)
    assert [t.number for t in done] == list(range(len(POINTS)))  # none lost, none twice
    assert {t.number: t.state.name for t in done} == {
        n: "FAIL" if n == FAILING else "COMPLETE" for n in range(len(POINTS))}, logs
    for t in done:
        assert t.params == {"train.lr": POINTS[t.number]}
        assert tune.trial_dir(t.number).is_dir()
        if t.number != FAILING:  # every step once, the preempted trial's included
            assert sorted(losses(tune.trial_dir(t.number))) == list(range(1, STEPS + 1))
            assert t.user_attrs["steps"] == STEPS
    assert done[preempted].user_attrs["launches"] == 2
    assert sum(t.user_attrs["launches"] for t in done) == len(POINTS) + 1
    log = (tune.trial_dir(preempted) / "train.log").read_text()
    stopped = [int(s) for s in re.findall(r"stopping at step (\d+): signal SIGUSR1", log)]
    assert len(stopped) == 1 and 4 <= stopped[0] < STEPS, log
    assert re.search(rf"resumed from \S+step_0*{stopped[0]} at step {stopped[0]}\b", log), log
    assert f"worker {me}: resuming its trial {preempted}" in logs[carrier]
    assert f"requeueing Slurm job {me}" in logs[carrier]
    assert not list((tune.study_dir / "workers").iterdir())


def test_a_resubmitted_array_takes_over_a_trial_left_by_a_task_not_requeued(jobs, tmp_path):
    """--no-requeue: the preempted task ends (exit 75) with its trial RUNNING; a new array (new
    task ids) trains the remaining trial, then resumes the orphaned one from its checkpoint."""
    data = make_dataset(tmp_path / "data")
    cfg, tune = write_study(tmp_path, data, POINTS[:2])
    submit = ("--chdir", tmp_path, "--array=0-0", ROOT / "slurm" / "tune.sbatch", cfg)
    first = jobs.sbatch(f"--output={tmp_path}/tune-%A_%a.out", "--no-requeue", *submit,
                        env=worker_faults(0.2))
    me = f"{first}_0"
    jobs.wait_for(lambda: claimed(tune, me) == 0 and last_step(tune.trial_dir(0)) >= 4,
                  f"task {me} 4 steps into trial 0", timeout=180, job_id=first)
    jobs.scancel("--signal=USR1", "--batch", me)
    (rec,) = jobs.wait(first, timeout=120)
    assert (rec["JobState"], rec["ExitCode"], rec["Restarts"]) == ("FAILED", "75:0", "0")
    assert [(t.number, t.state.name) for t in trials(tune)] == [(0, "RUNNING"), (1, "WAITING")]

    second = jobs.sbatch(f"--output={tmp_path}/tune-%A_%a.out", *submit, env=worker_faults(0.2))
    (rec,) = jobs.wait(second, timeout=180)
    log = (tmp_path / f"tune-{second}_0.out").read_text()
    assert rec["JobState"] == "COMPLETED", log
    done = trials(tune)
    assert [(t.number, t.state.name, t.user_attrs["launches"]) for t in done] == [
        (0, "COMPLETE", 2), (1, "COMPLETE", 1)], log
    assert f"worker {second}_0: taking over trial 0" in log
    assert sorted(losses(tune.trial_dir(0))) == list(range(1, STEPS + 1))
    assert not list((tune.study_dir / "workers").iterdir())
