"""Recovery inside the allocation with the PyPI mpich wheel's own `mpiexec` (Hydra) as the launcher.

Hydra ends the whole step when a node dies, usually before the survivors' heartbeat names it;
slurm/train.sbatch then asks the nodes themselves which are gone (one `srun --overlap` probe per
node and a TCP connection to its slurmd: hpctrain/distributed/sbatch_helper.py `gone`) and relaunches
`mpiexec -hosts` on the spare or the nodes left, as the srun path does. Asserted on the virtual
4-node cluster, one job losing two nodes (the spare's case, then the fewer-nodes case): each
relaunch, the state from the peer snapshots (no PFS read), kill -> next trained step <= 30 s, the
losses of the uninterrupted run; and that a rank's own error relaunches nothing. (The wheel under
`srun --mpi=pmi2` has no part here: no pmi2 flake.)
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


def lose(vcluster, vjobs, jid, run, out, node: str, at_step: int, nth: int) -> tuple[float, float, int, float]:
    """SIGKILL every process of `node` once step `at_step` is trained: seconds from the kill to the
    `nth` relaunch's start and to its first trained step, the step at the kill, and this machine's
    1-minute load average then."""
    vjobs.wait_for(lambda: last_step(run) >= at_step, f"step {at_step}", timeout=180, job_id=jid)
    vcluster.kill_node(node)
    t_kill, killed_at = time.monotonic(), last_step(run)
    vjobs.wait_for(lambda: len(re.findall(r"\] node \S+ lost: .*relaunching", out.read_text())) >= nth,
                   f"relaunch {nth}", timeout=30, job_id=jid)
    decided = time.monotonic() - t_kill
    vjobs.wait_for(lambda: out.read_text().count("[train.sbatch] recovery: ") >= nth,
                   f"relaunch {nth}'s first trained step", timeout=120, job_id=jid)
    return decided, time.monotonic() - t_kill, killed_at, os.getloadavg()[0]


def assert_resumed_from_peer_snapshots(log: str, killed_at: list[int], pfs_steps: list[int]) -> list[int]:
    """Each relaunch resumed from a peer snapshot newer than the PFS checkpoint before its kill."""
    resumed = [int(m) for m in re.findall(r"resumed from the peer snapshot of step (\d+) \(no PFS read\)", log)]
    assert len(resumed) == len(killed_at) and log.count("resumed from ") == len(killed_at), log
    for step, killed, pfs in zip(resumed, killed_at, pfs_steps):
        # recomputed: at most 2 snapshot intervals (the kill may come while one is being copied)
        assert step % 2 == 0 and pfs < step and killed - step <= 2 * 2, (resumed, killed_at, log)
    return resumed


def assert_recovered_in_time(decided: float, recovered: float, load: float) -> None:
    # Hydra's end (~1 s) + the probe (~0.5 s): what train.sbatch itself adds to a recovery
    assert decided <= 10, decided
    # 30 s: the target, met with the machine's cores at most 4x oversubscribed (starting 3
    # ranks, ~2.7 s of CPU each, is most of it); beyond that the ranks' start grows with the load
    bound = 30 * max(1.0, load / (4 * (os.cpu_count() or 1)))
    assert recovered <= bound, (recovered, bound)


def test_spare_then_fewer_nodes_after_losses_under_mpiexec(vcluster, vjobs, dataset, elastic_ref, tmp_path):
    """4 nodes, HPCTRAIN_SPARE_NODES=1, the wheel's mpiexec. node2 (rank 1) killed at step 19 ->
    train.sbatch finds node2 gone, node4 takes its place (mpiexec -hosts node1,node4,node3: dp 3),
    state from the peer snapshots, the uninterrupted 3-rank losses (<= 1e-5). Then node4 killed at
    step 29, no spare left -> node1,node3 (dp 2, grad_accum 3, global batch 12), again from the peer
    snapshots, the 3-rank losses within 1e-5 (another summation order)."""
    cfg, run = elastic_config(tmp_path, dataset, "spare")
    jid, out = submit(vjobs, tmp_path, cfg, 4, 1, *SNAPSHOTS, env={**SLOW, "HPCTRAIN_SPARE_NODES": "1"})
    losses, killed = [], []
    try:
        for node, at_step in (("node2", 19), ("node4", 29)):  # past the PFS checkpoints 15, 25
            killed.append(node)
            losses.append(lose(vcluster, vjobs, jid, run, out, node, at_step, len(killed)))
        (rec,) = vjobs.wait(jid, timeout=300)
    finally:
        for node in killed:
            vcluster.boot_node(node)
    log = out.read_text()
    assert rec["JobState"] == "COMPLETED", log
    assert "launcher mpiexec" in log and "training on node1 node2 node3; spare node(s): node4" in log, log
    assert "node node2 lost: spare node4 takes its place (3 node(s): node1 node4 node3;" in log, log
    assert "node node4 lost: relaunching on the 2 other node(s) (excluding node2 node4)" in log, log
    assert log.count("grad_accum 2 x dp 3") == 2 and log.count("grad_accum 3 x dp 2") == 1, log
    resumed = assert_resumed_from_peer_snapshots(log, [k for _, _, k, _ in losses], [15, 25])
    said = [float(m) for m in re.findall(r"recovery: ([\d.]+) s from the loss verdict", log)]
    for (decided, recovered, killed_at, load), step, verdict in zip(losses, resumed, said):
        print(f"mpiexec loss: kill -> relaunch {decided:.1f} s, -> first trained step {recovered:.1f} s "
              f"(verdict -> step {verdict:.1f} s), killed at step {killed_at}, resumed at {step}, "
              f"load {load:.1f} on {os.cpu_count()} cores")
        assert 0 < verdict < recovered, (verdict, recovered)
        assert_recovered_in_time(decided, recovered, load)
    assert_close_curve(run, elastic_ref)  # measured: bit-equal up to the 2nd resume, then 7.6e-8


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
