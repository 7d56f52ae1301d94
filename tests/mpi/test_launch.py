"""Launch under a real mpiexec: ranks, node grouping, threads, rendezvous, abort-on-error."""
import json
import sys
import time

import pytest

from tests.conftest import ROOT, mpirun, run_cmd

PROBE = ROOT / "tests" / "mpi" / "scripts" / "launch_probe.py"
pytestmark = pytest.mark.mpi


def views(outdir):
    return sorted((json.loads(p.read_text()) for p in outdir.glob("rank*.json")), key=lambda v: v["rank"])


def test_singleton_without_launcher(tmp_path):
    r = run_cmd([sys.executable, PROBE, tmp_path], timeout=120, check=True)
    (v,) = views(tmp_path)
    assert (v["world"], v["local_rank"], v["n_nodes"], v["backend"], v["sum"]) == (1, 0, 1, "gloo", 1.0)


def test_two_ranks_one_node_threads_split_cores(tmp_path):
    r = mpirun(2, [PROBE, tmp_path], timeout=120, check=True)
    vs = views(tmp_path)
    assert [v["rank"] for v in vs] == [0, 1]
    assert all(v["sum"] == 3.0 and v["local_size"] == 2 and v["n_nodes"] == 1 for v in vs)
    assert [v["local_rank"] for v in vs] == [0, 1]
    assert len({v["port"] for v in vs}) == 1
    # torch would default to 1 thread under mpiexec; we set cores / local ranks explicitly
    import os
    expect = max(1, (os.cpu_count() or 1) // 2)
    assert all(v["threads"] == v["torch_threads"] == expect for v in vs)


def test_forced_node_split_and_env_overrides(tmp_path):
    r = mpirun(4, [PROBE, tmp_path], timeout=180, check=True,
               env={"HPCTRAIN_RANKS_PER_NODE": "2", "MASTER_PORT": "29517", "HPCTRAIN_THREADS": "1",
                    "HPCTRAIN_IFACE": "lo"})
    vs = views(tmp_path)
    assert [(v["node_rank"], v["local_rank"]) for v in vs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(v["n_nodes"] == 2 and v["port"] == 29517 and v["sum"] == 10.0 for v in vs)
    assert all(v["addr"] == "127.0.0.1" for v in vs)  # the address of interface lo
    assert all(v["torch_threads"] == 1 for v in vs)


def test_pretend_nodes_keep_the_threads_of_the_ranks_sharing_the_machine(tmp_path):
    """HPCTRAIN_RANKS_PER_NODE=1 splits 2 ranks into 2 pretend nodes, but both still share this
    machine's cores: each rank's threads are what they are without the variable (#47: each got
    every core's threads, oversubscribed: 722 vs 46k tok/s), and the pretend layout stays."""
    env = {"HPCTRAIN_THREADS": "", "SLURM_CPUS_PER_TASK": ""}  # derived, not given
    (tmp_path / "real").mkdir()
    (tmp_path / "pretend").mkdir()
    mpirun(2, [PROBE, tmp_path / "real"], timeout=120, check=True, env=env)
    mpirun(2, [PROBE, tmp_path / "pretend"], timeout=120, check=True,
           env={**env, "HPCTRAIN_RANKS_PER_NODE": "1"})
    real, pretend = views(tmp_path / "real"), views(tmp_path / "pretend")
    assert [(v["n_nodes"], v["local_size"]) for v in real] == [(1, 2)] * 2
    assert [(v["n_nodes"], v["node_rank"], v["local_size"]) for v in pretend] == [(2, 0, 1), (2, 1, 1)]
    assert [v["torch_threads"] for v in pretend] == [v["torch_threads"] for v in real], (real, pretend)
    assert all(v["threads"] == v["torch_threads"] for v in pretend)


def test_exception_on_one_rank_aborts_all_quickly(tmp_path):
    t0 = time.monotonic()
    r = mpirun(2, [PROBE, tmp_path, "1"], timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert "injected failure on rank 1" in r.stderr
    assert elapsed < 30, f"abort took {elapsed:.1f}s (collective timeout is 60s)"


EXIT_AFTER_FINALIZE = ("from mpi4py import MPI; MPI.COMM_WORLD.Barrier(); "
                       "from hpctrain.__main__ import exit_without_teardown; exit_without_teardown(0)")


def test_a_finished_job_of_six_ranks_exits_zero_every_time():
    """A finished `train` rank ends with os._exit after MPI_Finalize. MPICH tells hydra "finalized"
    only from a C atexit hook, which os._exit skips: without hpctrain telling it, hydra SIGKILLed
    the ranks still exiting and the clean job ended with `EXIT CODE: 9` in 14 of 20 runs of 6 ranks
    (the async_diloco tp test failed a CI run this way). 5 runs: a regression passes ~0.3% of the time."""
    for attempt in range(5):
        r = mpirun(6, ["-c", EXIT_AFTER_FINALIZE], timeout=120)
        assert r.returncode == 0, (attempt, r.returncode, r.stdout[-600:])
