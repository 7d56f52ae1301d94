"""`hpctrain plan --sync-mode async_diloco`: the trainer's layout refusals, bytes per arrival in the
wire formats of plan/wire.py, server host memory, the replica row and step time, checkpoint bytes,
and one real run whose pushed_bytes / pulled_bytes the plan predicts exactly."""
from __future__ import annotations

import dataclasses

import pytest

from hpctrain.plan import async_model
from hpctrain.plan.cli import main
from hpctrain.plan.layout import Job
from hpctrain.plan.report import make_plan
from hpctrain.plan.shape import PRESETS
from hpctrain.plan.step_time import step_time
from tests.conftest import records
from tests.helpers import train, write_config

ONE_B = PRESETS["1b"]
JOB = Job(nodes=4, gpus_per_node=8, sync_mode="async_diloco", inner_steps=16, ps_servers=8)


def plan_of(**changes):
    return make_plan(ONE_B, dataclasses.replace(JOB, **changes))


@pytest.mark.parametrize("changes, words", [
    ({"tp": 2, "ps_servers": 3}, "--ps-servers 3 server ranks for replicas of 2 ranks"),
    ({"ps_servers": 32}, "--ps-servers 32 servers leave no replica among 32 ranks"),
    ({"replica_nodes": 1, "ps_servers": 4}, "fill whole groups of nodes (8 ranks each)"),
    ({"replica_nodes": 2, "ps_servers": 32}, "use a multiple of 16 below 32"),
    ({"dp": 32}, "leave parallel.dp at its default"),
    ({"data_parallel": "fsdp"}, "set sync.replica_nodes (FSDP inside each group of nodes)"),
    ({"precision": "fp16"}, "--precision fp16 needs loss scaling"),
    ({"pull_compression": "int4"}, "--pull-compression int4: sets the format"),
    ({"compression": "bf16", "error_feedback": True}, "--error-feedback: keeps async_diloco's push"),
    ({"sync_mode": "diloco", "ps_servers": 2}, "--ps-servers 2: the planner models it for"),
])
def test_layouts_the_trainer_refuses_are_refused_in_one_line(changes, words):
    with pytest.raises(ValueError) as e:
        plan_of(**changes)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_replicas_are_the_ranks_left_after_the_servers():
    assert async_model.replicas(dataclasses.replace(JOB, tp=2, ps_servers=8)) == 12  # (32-8)/2
    hier = dataclasses.replace(JOB, replica_nodes=1)  # 4 groups of 8 ranks, the last serves
    assert async_model.replicas(hier) == 3 and async_model.servers_per_part(hier) == 8
    assert plan_of(replica_nodes=1).job.batch == 8  # one replica's batch: 8 inner-dp ranks x 1


def test_bytes_per_arrival_in_each_wire_format():
    n = 1000  # 8 servers: slices of 125 elements
    base = dataclasses.replace(JOB)
    assert async_model.arrival_bytes(base, n) == {"pushed": 12000, "pulled": 12000, "catch-up pull": 4000}
    bf16 = async_model.arrival_bytes(dataclasses.replace(base, compression="bf16"), n)
    assert bf16["pushed"] == bf16["pulled"] == 8 * (250 + 16)
    # int8: each 125-element slice one block of 125 codes + a 4-byte scale; int4 pulls: the block
    # rounded up to an even 126 (63 bytes) + its scale
    mixed = async_model.arrival_bytes(dataclasses.replace(base, compression="int8",
                                                          pull_compression="int4"), n)
    assert (mixed["pushed"], mixed["pulled"]) == (8 * (125 + 4 + 16), 8 * (63 + 4 + 16))


def test_servers_hold_their_slice_and_views_and_a_small_node_is_flagged():
    p = plan_of(compression="int8")
    n = p.mem.local_params
    slice_ = -(-n // 8)
    assert p.servers["server rank (host): theta, momentum, accumulator (fp32)"] == 12 * slice_
    assert p.servers["server rank (host): views of each replica's weights (fp32)"] == 4 * slice_ * 24
    assert p.servers["replica pusher (host): start point (fp32)"] == 4 * n
    assert not any("async_diloco" in w for w in p.warnings)
    small = plan_of(compression="int8", node_memory=64 * 2 ** 30)
    assert any(w.startswith("async_diloco: 8 server rank(s) hold") and "--node-memory" in w
               for w in small.warnings), small.warnings


def test_the_arrival_is_one_row_amortized_over_the_round_and_exposed():
    p = plan_of(compression="int8")
    rows = {a: (link, sent) for a, link, sent, _ in p.comm}
    a = p.servers
    assert rows["dp"][1] == 0 and rows["replica"] == ("inter-node", (a["per arrival: pushed"]
                                                                      + a["per arrival: pulled"]) // 16)
    t = step_time(ONE_B, p.job, p.mem)
    assert t.dp_exposed == pytest.approx(rows["replica"][1] / JOB.inter_node_bw)
    assert t.tokens_per_step == 24 * 2048  # 24 replicas each step a 1-sequence batch at once
    hier = plan_of(replica_nodes=1)  # DDP inside a node, the servers' node across
    rows = {a: (link, sent) for a, link, sent, _ in hier.comm}
    assert rows["dp"][0] == "intra-node" and rows["dp"][1] > 0 and rows["replica"][0] == "inter-node"


def test_checkpoint_holds_the_global_model_state_and_every_replica():
    n = ONE_B.total_params()
    p = plan_of(compression="int8", error_feedback=True)
    assert p.checkpoint["bytes"] == 12 * n + 24 * 20 * n


def test_cli_accepts_async_diloco_and_prints_its_sync_line(capsys):
    rc = main(["--preset", "1b", "--nodes", "2", "--gpus-per-node", "4", "--sync-mode", "async_diloco",
               "--ps-servers", "4", "--replica-nodes", "1", "--compression", "int8",
               "--pull-compression", "int4", "--summary"])
    assert rc == 0
    rc = main(["--preset", "1b", "--nodes", "2", "--gpus-per-node", "4", "--sync-mode", "async_diloco",
               "--ps-servers", "4", "--compression", "int8", "--pull-compression", "int4"])
    out = capsys.readouterr().out
    assert rc == 0 and "sync async_diloco (4 replicas of 1 rank(s), 4 server rank(s)" in out
    assert "int8 pushes, int4 pulls" in out and "## async_diloco: bytes per arrival" in out


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, servers, sync", [
    (3, 2, ["--sync.compression=int8", "--sync.pull_compression=int4", "--sync.error_feedback=true"]),
    (3, 2, []),
    (4, 2, ["--parallel.tp=2", "--sync.compression=bf16"]),
], ids=["int8-int4", "fp32", "tp2-bf16"])
def test_the_plan_predicts_a_real_runs_bytes_per_arrival(tmp_path, dataset, ranks, servers, sync):
    """1 replica and its servers (2 per part; tp = 2: 1 per part), the default delayed Nesterov (1 replica: every arrival
    takes the momentum step, so every arrival pulls): each arrival's pushed_bytes / pulled_bytes /
    arrival_bytes equal the plan's, byte for byte. int8 pushes with error feedback and int4 pulls
    (2 slices of 60,320: 122,752 / 62,336 B); fp32 (theta, momentum, accumulator read and written
    back: 12 B per parameter each way); a tp = 2 replica's part (its leader's shard) in bf16."""
    cfg, run = write_config(tmp_path, dataset, "async")
    sync = ["--sync.mode=async_diloco", f"--sync.ps_servers={servers}", "--sync.inner_steps=2", *sync]
    train(ranks, cfg, "--train.steps=6", "--checkpoint.interval=100", "--train.eval_interval=0", *sync)
    arrivals = [r for r in records(run) if "arrival" in r]
    assert [r["arrival"] for r in arrivals] == [1, 2, 3]
    from hpctrain.plan.cli import build_parser, shape_and_job

    args = build_parser().parse_args(["--config", str(cfg), "--nodes", "1", "--gpus-per-node",
                                      str(ranks), *sync])  # train's spelling pastes back
    plan = make_plan(*shape_and_job(args))
    push, pull = plan.servers["per arrival: pushed"], plan.servers["per arrival: pulled"]
    assert {(r["pushed_bytes"], r["pulled_bytes"]) for r in arrivals} == {(push, pull)}
    assert {r["arrival_bytes"] for r in arrivals} == {push + pull}
