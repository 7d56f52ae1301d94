"""The study's bookkeeping without training: the budget under concurrent workers, a RUNNING trial
whose worker's Slurm job has ended handed to exactly one new worker, which Slurm states count as
ended."""
from __future__ import annotations

import os
import re
import sys
import threading
import time

import pytest

from hpctrain.distributed import slurm
from hpctrain.tune import space
from tests.conftest import run_cmd
from tests.tune_setup import TUNE_TOML

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
    assert study_mod.adopt_orphan(study, tune, "200_0", gone)[0] == 0
    assert study_mod.read_claim(tune, "200_0") == 0 and study_mod.read_claim(tune, "100_0") is None
    assert study_mod.adopt_orphan(study, tune, "200_1", gone) is None  # 100_1 alive, 2 finished
    assert study_mod.adopt_orphan(study, tune, "200_1", lambda name: True)[0] == 1
    assert study_mod.ask_new(study, tune) is None  # the budget: 3 trials, never more
    assert sorted(p.stem for p in (tmp_path / "workers").glob("*.json")) == ["100_2", "200_0", "200_1"]


def test_a_running_trial_that_no_worker_claims_is_adopted_once_its_training_ended(tmp_path):
    """#47: a worker killed while telling a trial's outcome tears the journal's last record; the
    trial reads RUNNING, its claim already dropped, and no worker ever took it again. Now one is
    adopted when no worker claims it and its run dir's lock says its training has ended; never
    while a live training holds that lock, nor a trial a worker has just asked (its claim is
    written under the ask lock)."""
    import json
    import socket

    tune = space.parse({"n_trials": 3, "journal": str(tmp_path / "s.journal"), "params": PARAMS})
    study = study_mod.open_study(tune)
    never = lambda name: False  # noqa: E731 - no claimed worker is gone
    for n in range(3):
        assert study_mod.ask_new(study, tune, f"w{n}").number == n
        assert study_mod.read_claim(tune, f"w{n}") == n  # written with the ask, under its lock
    assert study_mod.adopt_orphan(study, tune, "w9", never) is None  # every trial claimed
    study_mod.drop_claim(tune, "w0")  # trial 0: told, record torn, claim dropped: RUNNING, unclaimed
    study_mod.drop_claim(tune, "w1")  # trial 1: the same, but its training still holds its run dir
    run1 = tune.trial_dir(1)
    run1.mkdir(parents=True)
    (run1 / ".hpctrain.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    number, why = study_mod.adopt_orphan(study, tune, "w9", never)
    assert number == 0 and "no worker claims it" in why and "no run lock" in why, why
    assert study_mod.read_claim(tune, "w9") == 0
    assert study_mod.adopt_orphan(study, tune, "w8", never) is None  # 1: live lock; 0: w9's now
    (run1 / ".hpctrain.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": _gone_pid()}))
    number, why = study_mod.adopt_orphan(study, tune, "w8", never)
    assert number == 1 and "has exited" in why, why


def _gone_pid() -> int:
    import subprocess

    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)


def test_a_claim_of_a_process_gone_on_this_host(tmp_path):
    """A worker outside Slurm that was killed: its trial goes to another worker (search._orphan)."""
    import json
    import socket

    tune = space.parse({"journal": str(tmp_path / "s.journal"), "params": PARAMS})
    study_mod.write_claim(tune, "mine", 0)
    assert not study_mod.claim_process_gone(tune, "mine")  # this process
    for name, host, pid, gone in [("dead", socket.gethostname(), _gone_pid(), True),
                                  ("alive", socket.gethostname(), os.getppid(), False),
                                  ("elsewhere", "node-that-is-not-this-one", _gone_pid(), False)]:
        study_mod.claim_path(tune, name).write_text(json.dumps({"trial": 1, "host": host, "pid": pid}))
        assert study_mod.claim_process_gone(tune, name) is gone, name
    assert not study_mod.claim_process_gone(tune, "nobody")


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


# ---- the journal after a writer killed mid-append (#30) -----------------------------------------
def _journal_with_a_finished_study(tmp_path):
    """A study of 1 trial, told, and the TOML a `tune search` over it reads."""
    cfg = tmp_path / "tune.toml"
    cfg.write_text(TUNE_TOML.format(run=tmp_path, data=tmp_path / "no-data", n_trials=1, pruner="none"))
    tune = space.parse({"n_trials": 1, "journal": str(tmp_path / "study.journal"), "params": PARAMS})
    study = study_mod.open_study(tune)
    study.tell(study_mod.ask_new(study, tune).number, 0.5)
    return cfg, tmp_path / "study.journal"


def _status(journal):
    return run_cmd([sys.executable, "-m", "hpctrain", "tune", "status", journal], timeout=120)


@pytest.mark.parametrize("tail", [b'{"op_code":5,"worker_id":"a-1","trial_id":0,"user_att',
                                  b"\0" * 4096], ids=["torn-record", "nul-filled-tail"])
def test_a_torn_last_append_is_skipped_and_cut_by_the_next_writer(tmp_path, tail):
    from optuna.storages.journal import JournalFileBackend

    cfg, journal = _journal_with_a_finished_study(tmp_path)
    intact = journal.read_bytes()
    journal.write_bytes(intact + tail)  # a worker killed mid-append
    assert [t.value for t in study_mod.load_study(journal).trials] == [0.5]  # read past it
    # a real worker appends (the study's base config) after the torn tail, then finds it done
    r = run_cmd([sys.executable, "-m", "hpctrain", "tune", "search", cfg, "--worker", "w1"],
                timeout=120)
    assert r.returncode == 0 and f"dropped a torn last record ({len(tail)} bytes at byte " \
        f"{len(intact)}" in r.stderr, r.stderr
    data = journal.read_bytes()
    assert data.startswith(intact) and len(data) > len(intact) and data.endswith(b"\n")
    assert tail not in data
    assert len(JournalFileBackend(str(journal)).read_logs(0)) == data.count(b"\n")  # plain Optuna
    r = _status(journal)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert re.search(r"^\s+0\s+COMPLETE\s+0\.5000\s", r.stdout, re.M), r.stdout


@pytest.mark.parametrize("junk", [b"\0" * 40, b"<<<<<<< merged by hand"], ids=["nul", "garbage"])
def test_damage_inside_the_journal_is_one_line_naming_the_byte(tmp_path, junk):
    cfg, journal = _journal_with_a_finished_study(tmp_path)
    lines = journal.read_bytes().splitlines(keepends=True)
    offset = len(b"".join(lines[:2]))
    journal.write_bytes(b"".join(lines[:2]) + junk + b"\n" + b"".join(lines[2:]))
    before = journal.read_bytes()
    for args in (["status", journal], ["search", cfg, "--worker", "w1"]):
        r = run_cmd([sys.executable, "-m", "hpctrain", "tune", *args], timeout=120)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert len(errors) == 1 and f"{journal}: damaged study journal at byte {offset} " \
            f"(record 3" in errors[0], r.stderr
        assert f"truncate -s {offset} {journal}" in errors[0]
    assert journal.read_bytes() == before  # never written to
