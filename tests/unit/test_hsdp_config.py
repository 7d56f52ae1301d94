"""HSDP's key parallel.dp_shard (issue 52): dp = dp_replicate x dp_shard, FSDP only; every bad
value is one ConfigError naming the key; 0 (and all of dp) leave the layout plain FSDP."""
import pytest

from hpctrain import config
from hpctrain.distributed.mesh import ParallelDims
from hpctrain.errors import ConfigError
from tests.unit.test_config import MINIMAL


@pytest.fixture
def toml(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(MINIMAL)
    return p


@pytest.mark.parametrize("overrides", [
    ["--parallel.dp_shard=2"],                                   # DDP: nothing to shard
    ["--parallel.dp_shard=-1", "--parallel.data_parallel=fsdp"],
    ["--parallel.dp_shard=3", "--parallel.dp=4", "--parallel.data_parallel=fsdp"],
    ["--parallel.dp_shard=2", "--parallel.data_parallel=fsdp", "--sync.mode=diloco",
     "--sync.replica_nodes=1"],                                   # replicas train apart
])
def test_bad_dp_shard_names_the_key(toml, overrides):
    with pytest.raises(ConfigError) as e:
        config.load(toml, overrides)
    assert "parallel.dp_shard" in str(e.value) and "\n" not in str(e.value)


def test_dp_shard_must_divide_the_derived_dp(toml):
    """dp = 0 (derived from the world size): the mesh checks dp_shard against it."""
    cfg = config.load(toml, ["--parallel.data_parallel=fsdp", "--parallel.dp_shard=3", "--parallel.tp=2"])
    with pytest.raises(ConfigError) as e:
        ParallelDims.from_config(8, cfg.parallel)  # dp = 4
    assert "parallel.dp_shard" in str(e.value) and "dp=4" in str(e.value)


@pytest.mark.parametrize("world, overrides, replicate, shard", [
    (8, ["--parallel.dp_shard=2"], 4, 2),
    (8, ["--parallel.dp_shard=4", "--parallel.tp=2"], 1, 0),   # all of dp = plain FSDP
    (16, ["--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.pp=2"], 2, 2),
    (8, [], 1, 0),
])
def test_dp_replicate_is_dp_over_dp_shard(toml, world, overrides, replicate, shard):
    cfg = config.load(toml, ["--parallel.data_parallel=fsdp", *overrides])
    dims = ParallelDims.from_config(world, cfg.parallel)
    assert (dims.dp_replicate, dims.dp_shard) == (replicate, shard)
    assert dims.dp * dims.tp * dims.pp == world
