"""The planner's HSDP (parallel.dp_shard, issue 52): model state sharded over dp_shard ranks only,
parameter traffic on the shard group's link and the gradient shards' all-reduce across nodes,
offered on more than one node where it beats FSDP over all of dp, recommended with its reason and
flags `train` takes. Pure arithmetic, no MPI."""
from __future__ import annotations

import json

import pytest

from hpctrain import config
from hpctrain.plan import comm, memory, search
from hpctrain.plan.cli import main as plan_main
from hpctrain.plan.layout import Job
from hpctrain.plan.shape import PRESETS

SHAPE = PRESETS["1b"]
STATE = ("parameters (fp32)", "gradients (fp32)", "AdamW m, v (fp32)")


def _rank(**job):
    j = Job(**{"nodes": 8, "gpus_per_node": 8, "data_parallel": "fsdp", **job}).check(SHAPE)
    return j, memory.largest_rank(SHAPE, j)


def test_hsdp_model_state_is_fsdp_over_dp_shard_ranks():
    """HSDP 8 x 8 on 8 nodes holds what FSDP over one node's 8 ranks holds, 8 x FSDP over 64."""
    _, hsdp = _rank(dp_shard=8)
    _, one_node = _rank(nodes=1)
    _, fsdp64 = _rank()
    for key in STATE:
        assert hsdp.parts[key] == one_node.parts[key] == fsdp64.parts[key] * 8, key
    assert hsdp.peak == one_node.peak  # the same shards, gathered blocks and activations


def test_hsdp_parameter_traffic_stays_in_the_node():
    """FSDP over 64: one inter-node dp row. HSDP 8 x 8: the same formula over 8 ranks intra-node,
    plus the all-reduce of the fp32 gradient shard (n / 8) over the 8 replicas, inter-node."""
    fsdp_job, fsdp = _rank()
    hsdp_job, hsdp = _rank(dp_shard=8)
    rows = {a: (link, b) for a, link, b, _ in comm.rows_of_rank(SHAPE, fsdp_job, fsdp)}
    hrows = {a: (link, b) for a, link, b, _ in comm.rows_of_rank(SHAPE, hsdp_job, hsdp)}
    n = fsdp.local_params
    assert rows["dp"][0] == "inter-node" and "dp_replicate" not in rows
    assert hrows["dp"][0] == "intra-node" and hrows["dp_replicate"][0] == "inter-node"
    gather_scatter = (2 * 2 + 4) * n  # bf16 all-gathers fwd + bwd, fp32 reduce-scatter
    assert rows["dp"][1] == int(63 / 64 * gather_scatter)
    assert hrows["dp"][1] == int(7 / 8 * gather_scatter)
    assert hrows["dp_replicate"][1] == int(2 * 7 / 8 * n * 4 / 8)
    assert hrows["dp_replicate"][1] < rows["dp"][1] / 8


def test_dp_shard_is_checked_like_train():
    for bad in ({"dp_shard": 3}, {"dp_shard": 8, "data_parallel": "ddp"}):
        with pytest.raises(ValueError, match="--dp-shard"):
            _rank(**bad)


def test_hsdp_is_searched_on_many_nodes_only():
    one = Job(nodes=1, gpus_per_node=8).check(SHAPE)
    assert not any(j.dp_shard for j in search.layouts(one, one.batch))
    many = Job(nodes=8, gpus_per_node=8).check(SHAPE)
    shards = {(j.tp, j.dp_shard) for j in search.layouts(many, many.batch) if j.dp_shard}
    assert shards == {(1, 8), (2, 4), (4, 2)}  # a node's dp ranks (tp 8: one, plain DDP's)


def _json(capsys, args) -> dict:
    assert plan_main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_hsdp_is_recommended_where_the_inter_node_link_binds(capsys):
    """llama3-8b on 8 nodes: at 40 GB/s per GPU FSDP's transfers hide under compute (FSDP
    recommended, HSDP only costs memory: not listed); at 3 GB/s HSDP is recommended, with why and
    flags train's loader accepts."""
    args = ["--preset", "llama3-8b", "--nodes", "8"]
    fast = _json(capsys, args)
    assert not fast["recommended"].get("dp_shard") and "hsdp_why" not in fast["recommended"]
    assert not any(c.get("dp_shard") for c in fast["candidates"])
    slow = _json(capsys, [*args, "--inter-node-bw", "3GB"])
    rec = slow["recommended"]
    assert rec["layout"].startswith("hsdp ") and rec["dp_shard"] * rec["tp"] == 8
    assert "HSDP" in rec["hsdp_why"]
    plain = next(c for c in slow["candidates"] if c["layout"] == rec["layout"].replace(
        f"hsdp {rec['dp'] // rec['dp_shard']}x{rec['dp_shard']}", "fsdp"))
    assert rec["tokens_per_s"] > 2 * plain["tokens_per_s"] and rec["peak_bytes"] > plain["peak_bytes"]
    flags = rec["train_command"].split(" --config ")[1].split()[1:]
    cfg = config.load("configs/llama3_8b.toml", flags)
    assert cfg.parallel.dp_shard == rec["dp_shard"] and cfg.parallel.data_parallel == "fsdp"
