"""Fixtures for tests against a real local Slurm cluster: the cluster (session), job helpers.

The cluster is started once per session in a temporary directory (tests/slurm/cluster.py installs the
Debian packages if they are missing) and stopped at the end. Tests skip only when this machine cannot
have one (not Debian, not root and the packages missing, apt failing). Job state is read with
`scontrol show job` and the jobs' output files; `sacct -c` reads the clusters' jobcomp/filetxt job
history (no accounting database).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import BIN, ROOT
from tests.shared_dirs import shared_dir
from tests.slurm.cluster import ClusterUnavailable, LocalSlurm
from tests.slurm.vcluster import VirtualCluster

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


class Jobs:
    """sbatch / scancel / scontrol against one cluster, with the venv first on PATH in every job."""

    def __init__(self, cluster: LocalSlurm):
        self.cluster = cluster
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        env.update(cluster.env)
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        env["HPCTRAIN_PYTHON"] = sys.executable
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("HPCTRAIN_THREADS", None)
        self.env = env

    def _run(self, args, env=None, timeout=60):
        import subprocess

        return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                              env=dict(self.env, **(env or {})), cwd=ROOT)

    def sbatch(self, *args, env=None) -> str:
        r = self._run(["sbatch", "--parsable", *args], env=env)
        assert r.returncode == 0, f"sbatch failed: {r.stderr}"
        return r.stdout.strip().split(";")[0]

    def scancel(self, *args) -> None:
        r = self._run(["scancel", *args])
        assert r.returncode == 0, f"scancel {args} failed: {r.stderr}"

    def show(self, job_id: str) -> list[dict]:
        """One dict per job record (an array job has one per task)."""
        r = self._run(["scontrol", "show", "job", "-o", job_id])
        recs = []
        for line in r.stdout.splitlines():
            rec = {}
            for tok in line.split():
                k, sep, v = tok.partition("=")
                if sep and k not in rec:
                    rec[k] = v
            if rec:
                recs.append(rec)
        return recs

    def wait(self, job_id: str, timeout: float = 180, n_records: int = 1) -> list[dict]:
        """Poll until every record of the job is in a terminal state; return the records."""
        deadline = time.monotonic() + timeout
        recs = []
        while time.monotonic() < deadline:
            recs = self.show(job_id)
            if len(recs) >= n_records and all(r.get("JobState") in TERMINAL for r in recs):
                return recs
            time.sleep(0.5)
        self.scancel(job_id)
        raise AssertionError(f"job {job_id} not finished after {timeout}s: "
                             f"{[(r.get('JobId'), r.get('JobState')) for r in recs]}")

    def wait_for(self, predicate, what: str, timeout: float = 120, job_id: str | None = None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            if job_id and all(r.get("JobState") in TERMINAL for r in self.show(job_id)):
                raise AssertionError(f"job {job_id} ended before {what}")
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("slurm")
    cluster = LocalSlurm(prefix, cpus=4)
    try:
        cluster.start()
    except ClusterUnavailable as e:
        pytest.skip(f"no local Slurm cluster on this machine: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def jobs(slurm_cluster):
    return Jobs(slurm_cluster)


SMALL_SCRATCH_NODE = "node4"  # its node-local disk is a 64 KiB tmpfs: too small for any shard


@pytest.fixture(scope="session")
def vcluster(tmp_path_factory):
    """Four virtual nodes (network namespaces, own host names resolving to 127.0.1.1, own scratch
    disks); node4's scratch is full. Stopped at the end, and nothing of it may remain."""
    prefix = tmp_path_factory.mktemp("vcluster")
    yield from running(VirtualCluster(prefix, n_nodes=4, cpus=2, scratch_kib={4: 64}))


def running(cluster: VirtualCluster):
    """A fixture's body: start the virtual cluster (skip where this machine cannot have one), yield
    it, stop it, and nothing of it may remain."""
    try:
        cluster.start()
    except ClusterUnavailable as e:
        pytest.skip(f"no virtual multi-node cluster on this machine: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()
    assert not cluster.leftovers(), cluster.leftovers()


@pytest.fixture(scope="session")
def vjobs(vcluster):
    """Jobs on the virtual cluster start their ranks with the MPICH wheel's own `mpiexec` (Hydra,
    which reaches the other nodes through `srun`). Under `srun --mpi=pmi2` the wheel's MPI_Init
    sends Slurm 22.05's PMI-1 server lines of up to ~1,100 bytes (its address card, partly
    uninitialized memory, so the length changes from run to run), and the server cuts every line at
    1,024 bytes: the job then hangs in MPI_Init ("mpi/pmi2: value not properly terminated"; 3 of 3
    tries of one job in one CI run). Hydra's own PMI server has no such limit. The srun node-loss
    tests in test_multinode.py name `srun` themselves (the site-MPI path); test_recovery_mpiexec.py
    relaunches under this mpiexec (docs/multinode.md)."""
    jobs = Jobs(vcluster)
    jobs.env["HPCTRAIN_LAUNCHER"] = "mpiexec"
    jobs.env.setdefault("UCX_TLS", "tcp,self,sm")  # shorter cards: fewer cut PMI lines under srun
    return jobs


def metrics(run) -> list[dict]:
    p = Path(run) / "metrics.jsonl"
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written while we poll
            pass
    return out


@pytest.fixture(scope="session")
def multinode_dataset(tmp_path_factory):
    """test_multinode.py's 4-play dataset, sharded once per session (its `dataset`, also imported
    by test_recovery_mpiexec.py)."""
    from tests.slurm.test_multinode import shard_once

    return shared_dir(tmp_path_factory, "mn-data", lambda out: shard_once(out / "tiny")) / "tiny"


@pytest.fixture(scope="session")
def elastic_ref(multinode_dataset, tmp_path_factory):
    """The uninterrupted 3-rank run of test_multinode.py's ELASTIC on one node: the losses every
    node-loss test compares (test_multinode.py and test_recovery_mpiexec.py), trained once per
    session (tests/shared_dirs.py: xdist's workers share it)."""
    from tests.conftest import mpirun
    from tests.slurm.test_multinode import elastic_config

    def build(out):
        cfg, _ = elastic_config(out, multinode_dataset, "ref3")
        mpirun(3, ["-m", "hpctrain", "train", "--config", cfg], timeout=300, check=True)
    return losses(shared_dir(tmp_path_factory, "elastic-ref", build) / "ref3")


def losses(run) -> dict:
    return {r["step"]: r["loss"] for r in metrics(run) if "loss" in r}


def last_step(run) -> int:
    return max(losses(run), default=0)


def assert_same_files(got: Path, want: Path) -> None:
    """Two datasets hold the same files, byte for byte (manifest included)."""
    names = sorted(p.name for p in want.iterdir())
    assert names == sorted(p.name for p in got.iterdir()) and "manifest.json" in names
    for name in names:
        assert (got / name).read_bytes() == (want / name).read_bytes(), name


# The tiny GPT the Slurm job tests train: STEPS steps, validation every 10, no periodic checkpoint.
STEPS = 40
TINY = """
[run]
dir = "{run}"
[data]
path = "{data}"
[model]
n_layer = 2
n_head = 2
n_embd = 64
block_size = 64
vocab_size = 257
[train]
steps = 40
micro_batch_size = 4
lr = 3e-3
min_lr = 3e-4
warmup_steps = 5
eval_interval = 10
eval_batches = 2
log_interval = 10
[checkpoint]
interval = 1000
keep = 2
[slurm]
time_check_s = 1
"""


def stop_step(log: str) -> int:
    steps = [int(s) for s in re.findall(r"stopping at step (\d+)", log)]
    assert len(steps) == 1, log
    return steps[0]


def assert_same_curve(run, reference):
    got = losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))  # every step exactly once
    for step, loss in reference.items():
        assert got[step] == loss, f"step {step}: {got[step]!r} != {loss!r}"
