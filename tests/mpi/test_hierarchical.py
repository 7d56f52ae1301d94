"""Hierarchical layouts (sync.replica_nodes) under a real mpiexec -n 4 with pretend nodes
(HPCTRAIN_RANKS_PER_NODE): DDP or FSDP inside a replica of nodes, DiLoCo / Streaming DiLoCo across
replicas. The H = 1 anchor (= DDP over every rank), the replicas apart between rounds and equal
inside, which ranks each collective joins and what the rounds send, exact resume with FSDP inside
and streaming int4 across, and the one-line layout errors."""
import json
import sys

import pytest

from tests.conftest import ROOT, RUN_DATA, losses, model_section, mpirun
from tests.helpers import assert_equal_runs, copy_run_at, train, write_config
from tests.mpi.test_diloco import model_parameters

pytestmark = pytest.mark.mpi

HIER_GPT = RUN_DATA + """verify = "size"
cache_dir = "off"
""" + model_section(n_embd=32, block_size=32) + """[train]
steps = 8
warmup_steps = 0
micro_batch_size = 2
optimizer = "sgd"
lr = 0.05
min_lr = 0.005
grad_clip = 0
eval_interval = 4
eval_batches = 1
log_interval = 4
[checkpoint]
interval = 100
"""
ONE_RANK_NODES = {"HPCTRAIN_RANKS_PER_NODE": "1"}
TWO_RANK_NODES = {"HPCTRAIN_RANKS_PER_NODE": "2"}
DILOCO = ["--sync.mode=diloco", "--sync.outer_momentum=0"]


def test_h1_equals_ddp_over_every_rank(tmp_path, dataset):
    """4 pretend nodes, replicas of 2: DDP inside, DiLoCo across with H = 1, outer lr 1, momentum 0
    and inner SGD is DDP over all 4 ranks (the replicas' mean update is the global mean gradient's);
    a round sends the pseudo-gradient between the 2 replicas only."""
    cfg_a, run_a = write_config(tmp_path, dataset, "ddp", HIER_GPT)
    cfg_b, run_b = write_config(tmp_path, dataset, "hier", HIER_GPT)
    train(4, cfg_a, env=ONE_RANK_NODES)
    r = train(4, cfg_b, *DILOCO, "--sync.replica_nodes=2", "--sync.inner_steps=1",
              "--sync.outer_lr=1", env=ONE_RANK_NODES)
    assert "replicas=2" in r.stderr
    assert sorted(assert_equal_runs(run_a, run_b, 8, learns_by=0.1)) == [0, 4, 8]
    # ring all-reduce of every fp32 parameter: 2 (n - 1) / n x 4 bytes each per rank and step,
    # n = 4 ranks for DDP, n = 2 replicas for the rounds (the inner DDP is the replica's network)
    n = model_parameters(run_b)
    assert losses(run_a, "comm_bytes") == {s: s * 6 * n for s in range(1, 9)}
    assert losses(run_b, "comm_bytes") == {s: s * 4 * n for s in range(1, 9)}


def probe(tmp_path, cfg, *overrides, env):
    out = tmp_path / "probe"
    out.mkdir()
    mpirun(4, [ROOT / "tests/mpi/scripts/hierarchical_probe.py", out, "train", "--config", cfg,
               *overrides], env=env, check=True, timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def test_replicas_apart_between_rounds_equal_inside(tmp_path, dataset):
    """2 pretend nodes of 2 ranks, a replica per node, H = 4: the ranks of a replica hold the same
    weights after every step, the two replicas differ until a round ends, and every rank of both is
    equal after it. DDP's group is the node's 2 ranks, DiLoCo's the same rank of each node."""
    cfg, run = write_config(tmp_path, dataset, "hier", HIER_GPT)
    ranks = probe(tmp_path, cfg, *DILOCO, "--sync.replica_nodes=1", "--sync.inner_steps=4",
                  env=TWO_RANK_NODES)
    assert [(p["dp_group"], p["outer_group"]) for p in ranks] == [
        ([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])]
    for step in map(str, range(1, 9)):
        at = [p["steps"][step] for p in ranks]
        assert at[0] == at[1] and at[2] == at[3], step  # inside a replica: equal
        if int(step) % 4:
            assert at[0]["inner"] != at[2]["inner"] and at[0]["after"] == at[0]["inner"], step
        else:  # a round: both replicas start the next one from the global model
            assert at[0]["inner"] != at[2]["inner"] and at[0]["after"] == at[2]["after"], step
    loss = losses(run)
    assert loss[8] < loss[1] - 0.1, loss
    # rounds at steps 4 and 8 only: 2 replicas, 4 bytes per parameter each
    n = model_parameters(run)
    assert losses(run, "comm_bytes") == {s: (s // 4) * 4 * n for s in range(1, 9)}


FSDP_STREAMING = [*DILOCO, "--sync.replica_nodes=1", "--parallel.data_parallel=fsdp",
                  "--sync.streaming=true", "--sync.inner_steps=4", "--sync.fragments=2",
                  "--sync.overlap=true", "--sync.overlap_steps=1", "--sync.compression=int4",
                  "--train.steps=12", "--checkpoint.interval=6"]


def assert_step_6_resumes_bit_exact(tmp_path, dataset, overrides):
    """A 12-step run of 2 replicas of 2-rank nodes and its copy resumed from its step-6 checkpoint
    (a hierarchical sync state): steps 7..12, val losses and comm bytes bit for bit. The copy's config."""
    cfg_a, run_a = write_config(tmp_path, dataset, "straight", HIER_GPT)
    cfg_b, run_b = write_config(tmp_path, dataset, "resumed", HIER_GPT)
    train(4, cfg_a, *overrides, env=TWO_RANK_NODES)
    copy_run_at(run_a, run_b, 6)  # the straight run at its step-6 checkpoint
    state = json.loads((run_b / "checkpoints/step_00000006/trainer_state.json").read_text())["sync"]
    assert state["replicas"] == 2 and state["hierarchical"] is True
    r = train(4, cfg_b, *overrides, env=TWO_RANK_NODES)
    assert "resumed from" in r.stderr and "step_00000006" in r.stderr
    a, b = losses(run_a), losses(run_b)
    assert sorted(b) == list(range(1, 13)) and a[12] < a[1] - 0.1
    for step in range(7, 13):
        assert a[step] == b[step], f"step {step}: {a[step]!r} != {b[step]!r}"  # bit-identical
    assert losses(run_a, "val_loss") == losses(run_b, "val_loss")
    assert losses(run_a, "comm_bytes") == losses(run_b, "comm_bytes")
    return cfg_b


def test_fsdp_inside_streaming_int4_across_resumes_bit_exact(tmp_path, dataset):
    """FSDP over each node's 2 ranks, Streaming DiLoCo int4 across the 2 nodes; the straight run's
    checkpoint of step 6 (fragment 1 sent at step 6, merged after step 7: in flight at it) resumed
    in a copy: steps 7..12 bit for bit as the straight run. A checkpoint of replicas of nodes is
    refused by another layout, naming the key."""
    cfg_b = assert_step_6_resumes_bit_exact(tmp_path, dataset, FSDP_STREAMING)
    r = train(2, cfg_b, *FSDP_STREAMING, "--sync.replica_nodes=2", "--train.steps=14",
              env=ONE_RANK_NODES, check=False)  # 1 replica of 2 one-rank nodes
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "config key 'sync.replica_nodes': 1 DiLoCo replicas" in r.stderr


def test_layout_errors_are_one_line(tmp_path, dataset):
    """3 pretend nodes cannot form replicas of 2; a replica of one 2-rank node cannot hold
    tp=2 x pp=2 (pipeline stages inside a replica are fine: test_hierarchical_pp.py)."""
    cfg, _ = write_config(tmp_path, dataset, "run", HIER_GPT)
    r = mpirun(3, ["-m", "hpctrain", "train", "--config", cfg, *DILOCO, "--sync.replica_nodes=2"],
               env=ONE_RANK_NODES, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    line = next(x for x in r.stderr.splitlines() if "error:" in x)
    assert "sync.replica_nodes" in line and "3 nodes" in line, r.stderr
    r = train(4, cfg, *DILOCO, "--sync.replica_nodes=1", "--parallel.pp=2", "--parallel.tp=2",
              env=TWO_RANK_NODES, check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    line = next(x for x in r.stderr.splitlines() if "error:" in x)
    assert "config key 'sync.replica_nodes': a replica of 2 ranks" in line, r.stderr
    assert "tp=2 x pp=2" in line, r.stderr
