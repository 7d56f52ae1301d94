"""Slurm glue without a cluster: job info from the environment, durations, the srun-without-MPI
check, the slurm config section, and signal recording."""
import os
import signal
import socket

import pytest

from hpctrain import config, signals
from hpctrain.distributed import slurm
from hpctrain.errors import ConfigError, UserError
from tests.conftest import model_section

BASE = {"run": {"dir": "r"}, "data": {"path": "d"},
        "model": {"n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 8, "vocab_size": 8},
        "train": {"steps": 2, "micro_batch_size": 1, "warmup_steps": 0}}


@pytest.mark.parametrize("text, seconds", [
    ("5:00", 300), ("0:45", 45), ("1:02:03", 3723), ("2-03:04:05", 183845), ("1-00", 86400),
    ("7", 420), ("UNLIMITED", None), ("INVALID", None), ("", None), ("NOT_SET", None),
])
def test_parse_duration(text, seconds):
    assert slurm.parse_duration(text) == seconds


def test_job_from_env():
    assert slurm.SlurmJob.from_env({}) is None
    job = slurm.SlurmJob.from_env({"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-2]",
                                   "SLURM_JOB_NUM_NODES": "2", "SLURM_RESTART_COUNT": "3",
                                   "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "2"})
    assert (job.job_id, job.n_nodes, job.restart_count, job.name) == ("42", 2, 3, "40_2 (job 42)")
    assert job.describe() == "slurm: job 40_2 (job 42), restart 3, 2 nodes n[1-2]"


def test_remaining_from_job_end_time():
    import time

    job = slurm.SlurmJob.from_env({"SLURM_JOB_ID": "1"})
    left = slurm.remaining_seconds(job, {"SLURM_JOB_END_TIME": str(int(time.time()) + 100)})
    assert 98 <= left <= 100
    assert slurm.remaining_seconds(None) is None


def test_srun_without_mpi_plugin_is_refused():
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"}
    with pytest.raises(UserError, match=r"srun started 4 tasks but MPI sees a world of 1.*--mpi=pmi2"):
        slurm.check_launch(1, env)
    slurm.check_launch(4, env)                                  # srun --mpi=pmi2: fine
    slurm.check_launch(1, {**env, "SLURM_STEP_NUM_TASKS": "1"})  # one task: fine
    slurm.check_launch(1, {"SLURM_JOB_ID": "7"})                # batch shell, not a step
    slurm.check_launch(1, {})


def test_requeue_not_allowed_outside_slurm():
    assert slurm.requeue_allowed(None) == (False, "not running inside a Slurm job")


def test_slurm_config_section():
    cfg = config.from_dict(BASE)
    assert (cfg.slurm.requeue, cfg.slurm.signals, cfg.slurm.time_margin_s) == ("auto", "USR1,TERM,INT", 300.0)
    cfg = config.from_dict({**BASE, "slurm": {"requeue": False, "signals": "usr2, SIGTERM"}})
    assert (cfg.slurm.requeue, cfg.slurm.signals) == ("false", "usr2, SIGTERM")  # TOML bool accepted
    with pytest.raises(ConfigError, match="slurm.requeue"):
        config.from_dict({**BASE, "slurm": {"requeue": "maybe"}})
    with pytest.raises(ConfigError, match=r"config key 'slurm.signals': unknown signal 'USR3'"):
        config.from_dict({**BASE, "slurm": {"signals": "USR1,USR3"}})
    with pytest.raises(ConfigError, match=r"slurm.signals.*KILL cannot be caught"):
        config.from_dict({**BASE, "slurm": {"signals": "KILL"}})
    with pytest.raises(ConfigError, match="slurm.time_margin_s"):
        config.from_dict({**BASE, "slurm": {"time_margin_s": -1}})
    assert "--slurm.requeue=" in config.describe()


def test_signals_are_recorded_not_fatal():
    old = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        signals.install("USR1,USR2")
        os.kill(os.getpid(), signal.SIGUSR2)
        assert signals.received()[-1] == signal.SIGUSR2
        signals.install("USR1")  # USR2 no longer wanted: default action back, record dropped
        assert signal.SIGUSR2 not in signals.received()
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        signals._installed.clear()
        signals._received.clear()


def test_an_array_task_is_named_array_underscore_task(monkeypatch):
    """`scontrol requeue` / `show job` / `squeue` get `<array>_<task>`: the task that carries the
    array's own job id (SLURM_JOB_ID == SLURM_ARRAY_JOB_ID) would otherwise name the whole array."""
    carrier = slurm.SlurmJob.from_env({"SLURM_JOB_ID": "40", "SLURM_ARRAY_JOB_ID": "40",
                                       "SLURM_ARRAY_TASK_ID": "1"})
    other = slurm.SlurmJob.from_env({"SLURM_JOB_ID": "41", "SLURM_ARRAY_JOB_ID": "40",
                                     "SLURM_ARRAY_TASK_ID": "0"})
    plain = slurm.SlurmJob.from_env({"SLURM_JOB_ID": "42"})
    assert (carrier.slurm_id, other.slurm_id, plain.slurm_id) == ("40_1", "40_0", "42")
    calls = []

    class Done:
        returncode, stdout, stderr = 0, "JobId=40 BatchFlag=1 Requeue=1\n", ""

    monkeypatch.setattr(slurm.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(slurm.subprocess, "run", lambda args, **kw: calls.append(args) or Done())
    assert slurm.requeue(carrier) == (True, "JobId=40 BatchFlag=1 Requeue=1")
    assert slurm.requeue_decision("auto", carrier) == (True, "")
    assert slurm.requeue_decision("false", carrier) == (False, "slurm.requeue=false")
    slurm.remaining_seconds(carrier, {})
    assert calls == [["scontrol", "requeue", "40_1"], ["scontrol", "show", "job", "-o", "40_1"],
                     ["squeue", "-h", "-j", "40_1", "-o", "%L"]]


def test_a_time_limit_at_or_below_the_margin_is_refused(tmp_path):
    """Below slurm.time_margin_s (+ the measured time to a first checkpoint) every run would stop
    at once and be requeued again: refused, naming both numbers."""
    from hpctrain.distributed.preempt import TIMING_FILE, time_limit_error

    job = slurm.SlurmJob.from_env({"SLURM_JOB_ID": "9"})
    err = time_limit_error(job, 300.0, 300.0, tmp_path)
    assert "time limit 300 s" in err and "slurm.time_margin_s=300" in err and "above 300 s" in err
    assert time_limit_error(job, 301.0, 300.0, tmp_path) is None
    (tmp_path / TIMING_FILE).write_text('{"first_checkpoint_s": 40.5}\n')
    err = time_limit_error(job, 340.0, 300.0, tmp_path)
    assert "40.5 s" in err and TIMING_FILE in err and "above 341 s" in err
    assert time_limit_error(job, 341.0, 300.0, tmp_path) is None
    assert time_limit_error(job, 60.0, 0.0, tmp_path) is None     # margin off
    assert time_limit_error(job, None, 300.0, tmp_path) is None    # unlimited
    assert time_limit_error(None, 60.0, 300.0, tmp_path) is None   # not in Slurm
    (tmp_path / TIMING_FILE).write_text("{broken")
    assert "time limit 300 s" in time_limit_error(job, 300.0, 300.0, tmp_path)


def helper(*args, env=None):
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCTRAIN_"))}
    return subprocess.run([sys.executable, "-m", "hpctrain.distributed.sbatch_helper", *args],
                          capture_output=True, text=True, timeout=120, env={**clean, **(env or {})})


def test_the_wheel_gets_its_own_mpiexec_and_an_override_wins():
    """This venv's mpi4py loads the PyPI mpich wheel: the templates must start it with the
    wheel's mpiexec (srun --mpi=pmi2 cuts its PMI lines), and HPCTRAIN_LAUNCHER still wins."""
    r = helper("launcher")
    launcher, srun_mpi, mpiexec, why = r.stdout.rstrip("\n").split("\t")  # a path may hold spaces
    assert (r.returncode, launcher, srun_mpi) == (0, "mpiexec", "pmi2"), r.stderr
    assert mpiexec.endswith("/bin/mpiexec") and os.access(mpiexec, os.X_OK)
    assert "mpich wheel" in why and "libmpi" in why
    r = helper("launcher", env={"HPCTRAIN_LAUNCHER": "srun", "HPCTRAIN_SRUN_MPI": "pmix"})
    assert r.stdout.split("\t")[:2] == ["srun", "pmix"] and "HPCTRAIN_LAUNCHER=srun" in r.stdout


def test_the_batch_script_check_refuses_a_bad_config_in_one_line(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[run]\ndir = "r"\n[data]\npath = "d"\n'
                   + model_section(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=8)
                   + '[train]\nsteps = 2\nmicro_batch_size = 1\nwarmup_steps = 0\n')
    assert helper("check", cfg).returncode == 0
    r = helper("check", cfg, "--train.warmup_steps=5")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: ") and "train.warmup_steps" in r.stderr


def test_probing_nodes_that_slurm_cannot_reach_tells_nothing(tmp_path):
    """`sbatch_helper gone` (train.sbatch asks it which nodes are gone after mpiexec ended naming
    none): when no node answers, Slurm itself is unreachable, not every node lost: one error line
    naming the nodes, exit 1, so the script relaunches nothing. The controller refuses connections
    (a closed port) and MessageTimeout=1 makes srun/scontrol give up at once, not after 10 s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=gone\nSlurmctldHost=localhost\nSlurmctldPort={closed_port}\n"
                    "AuthType=auth/none\nCredType=cred/none\nMessageTimeout=1\n"
                    "NodeName=node-a,node-b CPUs=1\nPartitionName=debug Nodes=ALL Default=YES\n")
    r = helper("gone", "node-a", "node-b", env={"SLURM_CONF": str(conf), "HPCTRAIN_PROBE_TIMEOUT_S": "5"})
    assert r.returncode == 1 and r.stdout == "" and r.stderr.count("\n") == 1, r
    assert r.stderr.startswith("error: ") and "node-a,node-b" in r.stderr and "cannot" in r.stderr
