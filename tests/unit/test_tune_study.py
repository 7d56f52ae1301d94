"""The study's bookkeeping without training: the budget under concurrent workers, a RUNNING trial
whose worker's Slurm job has ended handed to exactly one new worker, which Slurm states count as
ended."""
from __future__ import annotations

import os
import threading
import time

import pytest

from hpctrain.distributed import slurm
from hpctrain.tune import space

pytest.importorskip("optuna")
from hpctrain.tune import study as study_mod  # noqa: E402

PARAMS = {"train.lr": {"log_uniform": [1e-4, 1e-2]}}


def test_ask_never_exceeds_the_budget_under_concurrent_workers(tmp_path):
    t = space.parse({"n_trials": 7, "journal": str(tmp_path / "s.journal"), "params": PARAMS})
    got, lock = [], threading.Lock()

    def worker():
        study = study_mod.open_study(t)  # each with its own storage object, as separate workers
        while (trial := study_mod.ask_new(study, t)) is not None:
            with lock:
                got.append(trial.number)
            study.tell(trial.number, 1.0)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(got) == list(range(7))
    study = study_mod.load_study(tmp_path / "s.journal")
    assert [tr.number for tr in study.trials] == list(range(7))
    assert not (tmp_path / "s.journal.ask.lock").exists()


def test_a_worker_name_in_use_by_a_live_process_is_refused(tmp_path):
    import subprocess
    import sys

    from hpctrain.errors import UserError

    tune = space.parse({"journal": str(tmp_path / "s.journal"), "params": PARAMS})
    study_mod.write_claim(tune, "local", 3)
    study_mod.check_claim_free(tune, "local")  # this process's own claim
    claim = tmp_path / "workers" / "local.json"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        claim.write_text(claim.read_text().replace(f'"pid": {os.getpid()}', f'"pid": {other.pid}'))
        with pytest.raises(UserError, match=rf"worker name 'local' is in use by process {other.pid}"):
            study_mod.check_claim_free(tune, "local")
    finally:
        other.kill()
        other.wait()
    study_mod.check_claim_free(tune, "local")  # that process is gone: its trial is ours
    assert study_mod.read_claim(tune, "local") == 3


def test_locks_left_by_a_killed_worker_are_taken_over(tmp_path):
    """Optuna's symlink lock on the journal and our ask lock, both an hour old: no hang."""
    tune = space.parse({"n_trials": 1, "journal": str(tmp_path / "s.journal"), "params": PARAMS})
    (tmp_path / "s.journal").touch()
    os.symlink(tmp_path / "s.journal", tmp_path / "s.journal.lock")
    (tmp_path / "s.journal.ask.lock").write_text("node7 4242\n")
    old = time.time() - 3600
    for name in ("s.journal.lock", "s.journal.ask.lock"):
        os.utime(tmp_path / name, (old, old), follow_symlinks=False)
    study = study_mod.open_study(tune)
    assert study_mod.ask_new(study, tune).number == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.journal"]


def test_a_trial_whose_worker_is_gone_goes_to_one_new_worker(tmp_path):
    tune = space.parse({"n_trials": 3, "journal": str(tmp_path / "s.journal"), "params": PARAMS})
    study = study_mod.open_study(tune)
    for n, worker in enumerate(("100_0", "100_1", "100_2")):
        assert study_mod.ask_new(study, tune).number == n
        study_mod.write_claim(tune, worker, n)
    study.tell(2, 1.0)  # finished, its claim left behind: never adopted
    gone = {"100_0", "100_2"}.__contains__
    assert study_mod.adopt_orphan(study, tune, "200_0", gone) == 0
    assert study_mod.read_claim(tune, "200_0") == 0 and study_mod.read_claim(tune, "100_0") is None
    assert study_mod.adopt_orphan(study, tune, "200_1", gone) is None  # 100_1 alive, 2 finished
    assert study_mod.adopt_orphan(study, tune, "200_1", lambda name: True) == 1
    assert study_mod.ask_new(study, tune) is None  # the budget: 3 trials, never more
    assert sorted(p.stem for p in (tmp_path / "workers").glob("*.json")) == ["100_2", "200_0", "200_1"]


@pytest.mark.parametrize("rc, out, err, ended", [
    (0, "JobId=5 ArrayJobId=4 ArrayTaskId=1 JobState=RUNNING Reason=None", "", False),
    (0, "JobId=5 JobState=PENDING Reason=BeginTime", "", False),  # requeued, waiting
    (0, "JobId=5 JobState=FAILED Reason=NonZeroExitCode", "", True),
    (0, "JobId=5 JobState=COMPLETED", "", True),
    (1, "", "slurm_load_jobs error: Invalid job id specified", True),  # forgotten (MinJobAge)
    (1, "", "slurm_load_jobs error: Unable to contact slurm controller", None),
])
def test_job_ended_reads_the_controller(monkeypatch, rc, out, err, ended):
    class Result:
        returncode, stdout, stderr = rc, out, err

    monkeypatch.setattr(slurm.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(slurm.subprocess, "run", lambda args, **kw: Result())
    assert slurm.job_ended("4_1") is ended


def test_metrics_tail_reads_only_complete_new_lines_and_restarts_on_a_replaced_file(tmp_path):
    """The trial watcher polls metrics.jsonl every 50 ms: it must see each validation loss once
    its line is complete, skip a half-written line until its newline comes, and start over when
    a resumed training replaces the file with a shorter one (metrics/jsonl.py)."""
    from hpctrain.tune.trial_run import MetricsTail

    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.val_losses() == {}  # not written yet
    with open(path, "ab") as f:
        f.write(b'{"step":1,"loss":4.0}\n{"step":2,"loss":3.9,"val_loss":3.5}\n{"step":3,"lo')
    assert tail.val_losses() == {2: 3.5}
    read_after_two = tail.offset
    with open(path, "ab") as f:
        f.write(b'ss":3.8,"val_loss":3.25}\n')
    assert tail.val_losses() == {2: 3.5, 3: 3.25}
    assert tail.offset > read_after_two  # the tail moved on: it did not re-read from 0 and stop
    tmp = tmp_path / "metrics.jsonl.tmp"
    tmp.write_bytes(b'{"step":1,"loss":4.0}\n{"step":2,"loss":3.9,"val_loss":3.0}\n')
    os.replace(tmp, path)  # a resume cuts the file back to step 2 and trains step 3 again
    assert tail.val_losses() == {2: 3.0}
