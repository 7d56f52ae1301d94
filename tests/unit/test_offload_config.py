"""parallel.offload's rules (issue 52; hpctrain/config_rules_offload.py): "all" needs FSDP2,
"optimizer" AdamW, both sync.mode = "sync"; each bad value one ConfigError naming the key; the
good ones load."""
import pytest

from hpctrain import config
from hpctrain.errors import ConfigError
from tests.unit.test_config import MINIMAL


@pytest.fixture
def toml(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(MINIMAL)
    return p


@pytest.mark.parametrize("overrides", [
    ["--parallel.offload=all"],                                                # DDP: no FSDP2 shards
    ["--parallel.offload=optimizer", "--train.optimizer=sgd"],
    ["--parallel.offload=optimizer", "--sync.mode=diloco"],
    ["--parallel.offload=all", "--parallel.data_parallel=fsdp", "--sync.mode=diloco",
     "--sync.replica_nodes=1"],
    ["--parallel.offload=gpu"],
])
def test_bad_offload_names_the_key(toml, overrides):
    with pytest.raises(ConfigError) as e:
        config.load(toml, overrides)
    assert "parallel.offload" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides", [
    ["--parallel.offload=optimizer"], ["--parallel.offload=optimizer", "--parallel.data_parallel=fsdp"],
    ["--parallel.offload=all", "--parallel.data_parallel=fsdp"], []])
def test_good_offload_loads(toml, overrides):
    cfg = config.load(toml, overrides)
    assert cfg.parallel.offload == (overrides[0].split("=")[1] if overrides else "none")
