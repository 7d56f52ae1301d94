"""`hpctrain plan` with sync.replica_nodes: DDP's all-reduce inside a replica of nodes on that
replica's link, DiLoCo's rounds in a row of their own across the replicas (inter-node)."""
from __future__ import annotations

import dataclasses

import pytest

from hpctrain.plan import comm
from hpctrain.plan.layout import Job
from hpctrain.plan.report import make_plan
from hpctrain.plan.shape import PRESETS
from hpctrain.plan.step_time import step_time
from hpctrain.plan.wire import bytes_sent

JOB = Job(nodes=4, gpus_per_node=8, sync_mode="diloco", inner_steps=32, compression="int4")


def rows(job: Job) -> dict:
    plan = make_plan(PRESETS["1b"], job.check(PRESETS["1b"]))
    return {axis: (link, sent) for axis, link, sent, _ in plan.comm}, plan


@pytest.mark.parametrize("replica_nodes, inner_link", [(1, "intra-node"), (2, "inter-node")])
def test_inner_all_reduce_in_the_replica_rounds_across(replica_nodes, inner_link):
    got, plan = rows(dataclasses.replace(JOB, replica_nodes=replica_nodes))
    n = plan.mem.local_params
    inner = 8 * replica_nodes  # ranks per replica
    assert got["dp"] == (inner_link, int(2 * (inner - 1) / inner * 4 * n))
    replicas = 4 // replica_nodes
    assert got["replica"] == ("inter-node", bytes_sent(n, replicas, "int4") // 32)
    flat, _ = rows(JOB)  # every rank its own replica: 32 replicas, no dp row of its own
    assert "replica" not in flat and flat["dp"][1] == bytes_sent(n, 32, "int4") // 32
    # the step time counts the replica's all-reduce and the rounds, neither hidden (DiLoCo)
    mem = plan.mem
    t = step_time(PRESETS["1b"], plan.job, mem)
    link_bw = {"intra-node": JOB.intra_node_bw, "inter-node": JOB.inter_node_bw}
    assert t.dp_exposed == pytest.approx(got["dp"][1] / link_bw[inner_link]
                                         + got["replica"][1] / JOB.inter_node_bw)


def test_replica_nodes_must_divide_the_nodes():
    with pytest.raises(ValueError, match="--replica-nodes 3"):
        dataclasses.replace(JOB, replica_nodes=3).check(PRESETS["1b"])
    with pytest.raises(ValueError, match="--replica-nodes 1"):
        dataclasses.replace(JOB, replica_nodes=1, sync_mode="sync").check(PRESETS["1b"])
    assert comm.link(16, JOB) == "inter-node"


def test_pipeline_stages_inside_a_replica():
    """2 replicas of 2 nodes, each pp=4 x dp=2 x tp=2: DDP's all-reduce joins a stage's 2 dp
    ranks (4 consecutive ranks with tp: one node), the stages' neighbours are 4 ranks apart (one
    node), DiLoCo's rounds send this stage's parameters between the 2 replicas."""
    got, plan = rows(dataclasses.replace(JOB, replica_nodes=2, pp=4, tp=2))
    n = plan.mem.local_params  # one stage's tp shard
    assert plan.job.dp_size == 4 and plan.job.replicas == 2
    assert got["dp"] == ("intra-node", int(2 * (1 / 2) * 4 * n))
    assert got["replica"] == ("inter-node", bytes_sent(n, 2, "int4") // 32)
    assert got["pp"][0] == "intra-node" and got["pp"][1] > 0
    with pytest.raises(ValueError, match="--replica-nodes 1: .* tp x pp = 16 divides"):
        dataclasses.replace(JOB, replica_nodes=1, pp=8, tp=2).check(PRESETS["1b"])
