"""Two sites joined by a slow link (tests/slurm/sites.py): the virtual cluster's second layout.

node1 node2 on one bridge, node3 node4 on another, the two joined by a veth pair shaped to 50 Mbit/s
with tc's token bucket. The fixture measures the rate a TCP transfer gets across and inside a site;
Slurm sees all four nodes (site 2's slurmd reaches slurmctld across the link) and a DDP job on all
four trains, its all-reduces crossing the shaped link. bench/two_sites.py times DDP against the
hierarchical layout on this cluster.
"""
from __future__ import annotations

import pytest

from tests.slurm import sites
from tests.slurm.conftest import Jobs, metrics, running
from tests.slurm.vcluster import VirtualCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

RATE = "50mbit"
SITES = [["node1", "node2"], ["node3", "node4"]]


@pytest.fixture(scope="module")
def two_sites(tmp_path_factory):
    yield from running(VirtualCluster(tmp_path_factory.mktemp("two_sites"), n_nodes=4, cpus=2,
                                      sites=SITES, link_rate=RATE))


def test_link_is_shaped_to_the_rate_and_slurm_sees_both_sites(two_sites):
    configured = sites.rate_bits(RATE)
    rates = two_sites.link_rates
    assert abs(rates["cross_site_bits"] - configured) <= 0.25 * configured, rates
    assert rates["intra_site_bits"] >= 3 * configured, rates  # measured 0.31 (load 35) - 7 Gbit/s
    states = two_sites.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split()
    assert dict(zip(states[::2], states[1::2])) == {n: "idle" for n in two_sites.nodes}, states
    # the second site hangs off its own bridge, joined to the first only by the shaped pair
    master = {n: sites.master_of(f"{two_sites.bridge}n{k}") for k, n in enumerate(two_sites.nodes, 1)}
    assert master == {"node1": two_sites.bridge, "node2": two_sites.bridge,
                      "node3": f"{two_sites.bridge}b2", "node4": f"{two_sites.bridge}b2"}


def test_ddp_across_both_sites_trains_through_the_link(two_sites, one_play, tmp_path):
    from tests.conftest import ROOT, TINY_TRAIN

    jobs = Jobs(two_sites)
    jobs.env["HPCTRAIN_LAUNCHER"] = "mpiexec"  # the wheel's Hydra (tests/slurm/conftest.py: vjobs)
    # without sm: the nodes share one kernel and UCX would move MPI's all-reduce by shared memory
    # and CMA, past the link (3.8 MB crossed in 30 DDP steps of 0.43M params instead of ~100 MB)
    jobs.env["UCX_TLS"] = "tcp,self"
    run, cfg = tmp_path / "ddp", tmp_path / "ddp.toml"
    cfg.write_text(TINY_TRAIN.format(run=run, data=one_play, steps=6))
    before = sites.link_bytes(two_sites.bridge)
    jid = jobs.sbatch(f"--output={tmp_path}/train-%j.out", "--chdir", tmp_path, "--nodes=4",
                      "--ntasks-per-node=1", ROOT / "slurm" / "train.sbatch", cfg)
    (rec,) = jobs.wait(jid, timeout=180)
    log = (tmp_path / f"train-{jid}.out").read_text()
    assert rec["JobState"] == "COMPLETED", log
    assert "4 node(s), rendezvous" in log, log
    assert [m["step"] for m in metrics(run) if "loss" in m] == list(range(1, 7)), log
    after = sites.link_bytes(two_sites.bridge)
    # the all-reduces of the gradients (88 KB of fp32 each) cross the link both ways
    crossed = {end: after[end] - before[end] for end in after}
    assert min(crossed.values()) > 50_000, crossed  # measured 117-391 KB (comm_bytes: 132 KB/step)
