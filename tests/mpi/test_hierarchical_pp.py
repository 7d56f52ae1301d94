"""Hierarchical layouts with pipeline stages inside a replica (sync.replica_nodes with
parallel.pp = 2) under a real mpiexec -n 4 with 2-rank pretend nodes (HPCTRAIN_RANKS_PER_NODE): a
replica = one node = 2 pipeline stages, DiLoCo across the 2 replicas, each stage averaged with
the same stage of the other replica. The H = 1 anchor (= DDP x PP over every rank), which ranks
each collective joins, the replicas apart between rounds and equal after them, and exact resume
with Streaming DiLoCo (fragments by blocks: one block per stage)."""

import pytest

from tests.conftest import losses
from tests.helpers import assert_equal_runs, train, write_config
from tests.mpi.test_hierarchical import (DILOCO, HIER_GPT, TWO_RANK_NODES, assert_step_6_resumes_bit_exact,
                                         probe)

pytestmark = pytest.mark.mpi

PP2 = ["--parallel.pp=2", "--parallel.pp_schedule=gpipe", "--train.grad_accum=2"]
HIER_PP = [*DILOCO, *PP2, "--sync.replica_nodes=1"]


def test_h1_with_stages_equals_ddp_x_pp_over_every_rank(tmp_path, dataset):
    """Replicas of one 2-rank node, each pp=2 x dp=1; DiLoCo with H = 1, outer lr 1, momentum 0
    and inner SGD is DDP x PP over all 4 ranks (dp=2, pp=2): the replicas' mean update of each
    stage is the global mean gradient's. The loss (summed over the stages, averaged over the
    replicas) and the evaluation match the plain run's."""
    cfg_a, run_a = write_config(tmp_path, dataset, "ddp_pp", HIER_GPT)
    cfg_b, run_b = write_config(tmp_path, dataset, "hier_pp", HIER_GPT)
    train(4, cfg_a, *PP2, env=TWO_RANK_NODES)
    r = train(4, cfg_b, *HIER_PP, "--sync.inner_steps=1", "--sync.outer_lr=1", env=TWO_RANK_NODES)
    assert "replicas=2" in r.stderr
    assert sorted(assert_equal_runs(run_a, run_b, 8, learns_by=0.1)) == [0, 4, 8]


def test_stages_apart_between_rounds_equal_after(tmp_path, dataset):
    """H = 4: DiLoCo's group of rank r is stage r % 2 of both replicas ([0, 2] and [1, 3]); each
    replica's dp group is the rank alone (dp=1 inside). The same stage differs between the
    replicas inside a round and is equal after every round."""
    cfg, run = write_config(tmp_path, dataset, "hier_pp", HIER_GPT)
    ranks = probe(tmp_path, cfg, *HIER_PP, "--sync.inner_steps=4", env=TWO_RANK_NODES)
    assert [(p["dp_group"], p["outer_group"]) for p in ranks] == [
        ([0], [0, 2]), ([1], [1, 3]), ([2], [0, 2]), ([3], [1, 3])]
    for step in map(str, range(1, 9)):
        at = [p["steps"][step] for p in ranks]
        for a, b in ((0, 2), (1, 3)):  # stage 0 of both replicas, stage 1 of both
            assert at[a]["inner"] != at[b]["inner"], step
            if int(step) % 4:
                assert at[a]["after"] == at[a]["inner"] and at[a]["after"] != at[b]["after"], step
            else:
                assert at[a]["after"] == at[b]["after"], step
        assert at[0]["after"] != at[1]["after"]  # two stages: different parameters
    loss = losses(run)
    assert loss[8] < loss[1] - 0.1, loss
    sent = losses(run, "comm_bytes")  # rank 0: stage 0's parameters at steps 4 and 8 only
    assert sent[1] == sent[3] == 0 and sent[4] > 0 and sent[8] == 2 * sent[4] == 2 * sent[7]


STREAMING_PP = [*HIER_PP, "--sync.streaming=true", "--sync.inner_steps=4", "--sync.fragments=2",
                "--sync.overlap=true", "--sync.overlap_steps=1", "--sync.compression=int8",
                "--train.steps=12", "--checkpoint.interval=6"]


def test_streaming_across_stages_resumes_bit_exact(tmp_path, dataset):
    """Streaming DiLoCo over 2 fragments of blocks (fragment 0 = the embeddings + block 0, all on
    stage 0; fragment 1 = block 1 + the head, all on stage 1: each stage holds one fragment and
    none of the other) resumed from the step-6 checkpoint, whose JSON state is rank 0's (stage
    0's), while fragment 1 is in flight on stage 1: steps 7..12 bit for bit."""
    assert_step_6_resumes_bit_exact(tmp_path, dataset, STREAMING_PP)
