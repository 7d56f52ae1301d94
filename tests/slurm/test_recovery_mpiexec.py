"""Recovery inside the allocation with the PyPI mpich wheel's own `mpiexec` (Hydra) as the launcher.

Hydra ends the whole step when a node dies, usually before the survivors' heartbeat names it;
slurm/train.sbatch then asks the nodes themselves which are gone (one `srun --overlap` probe per
node, with a timeout: hpctrain/distributed/sbatch_helper.py `gone`) and relaunches `mpiexec -hosts`
on the spare or the nodes left, as the srun path does. Asserted on the virtual 4-node cluster: the
relaunch, the state from the peer snapshots (no PFS read), kill -> next trained step <= 30 s, the
losses of the uninterrupted run. (The wheel under `srun --mpi=pmi2` has no part here: no pmi2 flake.)
"""
from __future__ import annotations

import os
import re
import time

import pytest

from tests.slurm.conftest import last_step
from tests.slurm.test_multinode import (SLOW, assert_close_curve, dataset, elastic_config,  # noqa: F401
                                        elastic_ref, submit)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SNAPSHOTS = ["--dist.heartbeat_timeout_s=8", "--checkpoint.snapshot_interval=2",
             "--checkpoint.snapshot_dir=/dev/shm"]  # each node's own tmpfs (node4's scratch is full)


def kill_and_time(vcluster, vjobs, jid, run, out, node: str) -> tuple[float, float, int, float]:
    """SIGKILL every process of `node` past step 19 (the PFS checkpoint of 15, snapshots of 16 and
    18): seconds from the kill to the relaunch's start and to its first trained step, the step at
    the kill, and this machine's 1-minute load average then."""
    try:
        vjobs.wait_for(lambda: last_step(run) >= 19, "step 19", job_id=jid)
        vcluster.kill_node(node)
        t_kill, killed_at = time.monotonic(), last_step(run)
        vjobs.wait_for(lambda: "relaunching from the newest checkpoint" in out.read_text(),
                       "the relaunch", timeout=30, job_id=jid)
        decided = time.monotonic() - t_kill
        vjobs.wait_for(lambda: "[train.sbatch] recovery: " in out.read_text(),
                       "the relaunch's first trained step", timeout=120, job_id=jid)
        recovered = time.monotonic() - t_kill
        load = os.getloadavg()[0]
        (rec,) = vjobs.wait(jid, timeout=300)
    finally:
        vcluster.boot_node(node)
    assert rec["JobState"] == "COMPLETED", out.read_text()
    # Hydra's end (~1 s) + the probe (~0.5 s): what train.sbatch itself adds to a recovery
    assert decided <= 10, (decided, out.read_text())
    return decided, recovered, killed_at, load


def assert_resumed_from_peer_snapshot(log: str, killed_at: int) -> int:
    resumed = [int(m) for m in re.findall(r"resumed from the peer snapshot of step (\d+) \(no PFS read\)", log)]
    assert len(resumed) == 1 and log.count("resumed from ") == 1, log
    # recomputed: at most 2 snapshot intervals (the kill may come while one is still being copied)
    assert resumed[0] % 2 == 0 and 15 < resumed[0] and killed_at - resumed[0] <= 2 * 2, (killed_at, log)
    return resumed[0]


def test_spare_takes_the_place_of_a_node_lost_under_mpiexec(vcluster, vjobs, dataset, elastic_ref,
                                                              tmp_path):
    """4 nodes, HPCTRAIN_SPARE_NODES=1, the wheel's mpiexec: node2 (rank 1) killed -> train.sbatch
    finds node2 gone, node4 takes its place (mpiexec -hosts node1,node4,node3), dp 3, state from
    the peer snapshots, the uninterrupted 3-rank losses."""
    cfg, run = elastic_config(tmp_path, dataset, "spare")
    jid, out = submit(vjobs, tmp_path, cfg, 4, 1, *SNAPSHOTS, env={**SLOW, "HPCTRAIN_SPARE_NODES": "1"})
    decided, recovered, killed_at, load = kill_and_time(vcluster, vjobs, jid, run, out, "node2")
    log = out.read_text()
    assert "launcher mpiexec" in log and "training on node1 node2 node3; spare node(s): node4" in log, log
    assert "node node2 lost: spare node4 takes its place (3 node(s): node1 node4 node3;" in log, log
    assert log.count("grad_accum 2 x dp 3") == 2 and log.count("3 node(s), rendezvous") == 2, log
    resumed = assert_resumed_from_peer_snapshot(log, killed_at)
    (said,) = [float(m) for m in re.findall(r"recovery: ([\d.]+) s from the loss verdict", log)]
    print(f"mpiexec spare: kill -> relaunch {decided:.1f} s, -> first trained step {recovered:.1f} s "
          f"(verdict -> step {said:.1f} s), killed at step {killed_at}, resumed at {resumed}, "
          f"load {load:.1f} on {os.cpu_count()} cores")
    assert_close_curve(run, elastic_ref)
    # 30 s: the target, met with the machine's cores at most 4x oversubscribed (starting 3
    # ranks, ~2.7 s of CPU each, is most of it); beyond that the ranks' start grows with the load
    bound = 30 * max(1.0, load / (4 * (os.cpu_count() or 1)))
    assert 0 < said < recovered <= bound, (said, recovered, bound, log)


def test_a_ranks_own_error_under_mpiexec_is_not_a_node_loss(vjobs, tmp_path):
    """A rank's error ends mpiexec as a lost node does (status != 0, no node named): every node
    answers the probe, and the job fails with that status, no relaunch."""
    cfg, _ = elastic_config(tmp_path, tmp_path / "no-such-data", "bad")
    jid, out = submit(vjobs, tmp_path, cfg, 3, 1)
    (rec,) = vjobs.wait(jid, timeout=180)
    log = out.read_text()
    assert rec["JobState"] == "FAILED" and "no-such-data" in log and "Traceback" not in log, log
    assert "no lost node named: probing node1 node2 node3" in log, log
    (took,) = [float(m) for m in re.findall(r"every node answered \(3 probed in ([\d.]+) s\)", log)]
    assert "[train.sbatch] node " not in log and log.count("training failed with status ") == 1, log
    print(f"mpiexec rank error: 3 nodes probed in {took:.1f} s, no relaunch")
