"""Layout arithmetic without processes: mesh sizes and rank order, stage split, config validation."""
import pytest

from hpctrain import config
from hpctrain.distributed.mesh import ParallelDims
from hpctrain.errors import ConfigError
from hpctrain.plan.stages import layer_costs, split_stages, stages_of_rank

BASE = {"run": {"dir": "r"}, "data": {"path": "d"},
        "model": {"n_layer": 4, "n_head": 4, "n_embd": 64, "block_size": 32, "vocab_size": 257},
        "train": {"steps": 10, "micro_batch_size": 2}}


def test_dp_is_derived_and_sizes_must_match_world():
    d = ParallelDims.from_world(8, tp=2, pp=2)
    assert (d.pp, d.dp, d.tp) == (2, 2, 2) and d.axis_names == ("pp", "dp", "tp")
    with pytest.raises(ConfigError, match=r"dp=3 x tp=1 x pp=1 = 3 does not match the world size 4"):
        ParallelDims.from_world(4, dp=3)
    with pytest.raises(ConfigError, match=r"tp=3 x pp=1 = 3 does not divide the world size 4"):
        ParallelDims.from_world(4, tp=3)


def test_rank_order_keeps_tp_innermost():
    d = ParallelDims.from_world(16, tp=2, pp=2)  # dp = 4
    assert [d.coords_of(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert [d.coords_of(r)["dp"] for r in range(0, 8, 2)] == [0, 1, 2, 3]
    assert d.coords_of(8) == {"pp": 1, "dp": 0, "tp": 0}
    for r in range(16):
        assert d.rank_of(**d.coords_of(r)) == r
    # with 4 ranks per node (block placement), every TP group {2k, 2k+1} is inside one node
    assert all(r // 4 == (r + 1) // 4 for r in range(0, 16, 2))


def test_split_balances_cost_not_count():
    emb, blocks, head = 0.0, [1.0] * 8, 0.0
    assert [len(b) for b in split_stages(2, emb, blocks, head)] == [4, 4]
    # an expensive head (big vocab) moves blocks off the last stage
    assert [len(b) for b in split_stages(2, 0.0, blocks, 4.0)] == [6, 2]
    assert [len(b) for b in split_stages(4, 2.0, blocks, 2.0)] == [1, 3, 3, 1]
    bounds = split_stages(3, *layer_costs(12, 768, 1024, 50304))
    assert [i for b in bounds for i in b] == list(range(12)) and all(len(b) >= 1 for b in bounds)
    assert len(bounds[-1]) < len(bounds[1])  # GPT-2 small: the head costs about 3 blocks
    with pytest.raises(ValueError):
        split_stages(5, 0.0, [1.0] * 4, 0.0)


def test_looped_stage_placement():
    assert stages_of_rank(0, 2, 2) == [0, 2] and stages_of_rank(1, 2, 2) == [1, 3]
    assert stages_of_rank(1, 4, 1) == [1]


@pytest.mark.parametrize("parallel, key", [
    ({"tp": 3}, "parallel.tp"),                      # n_head 4 not divisible
    ({"pp": 5}, "parallel.pp"),                      # more stages than blocks
    ({"pp": 2, "pp_schedule": "interleaved", "pp_virtual_stages": 3}, "parallel.pp"),
    ({"data_parallel": "zero3"}, "parallel.data_parallel"),
    ({"pp_schedule": "zb"}, "parallel.pp_schedule"),
    ({"activation_checkpoint": "some"}, "parallel.activation_checkpoint"),
    ({"dp": -1}, "parallel.dp"),
])
def test_bad_parallel_config_names_the_key(parallel, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config.from_dict({**BASE, "parallel": parallel})


def test_parallel_defaults_and_help():
    cfg = config.from_dict(BASE)
    p = cfg.parallel
    assert (p.dp, p.tp, p.pp, p.data_parallel, p.activation_checkpoint) == (0, 1, 1, "ddp", "none")
    text = config.describe()
    for key in ("parallel.tp", "parallel.pp_schedule", "parallel.activation_checkpoint", "parallel.ac_every"):
        assert f"--{key}=" in text
