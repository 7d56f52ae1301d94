"""configs/dpo.toml (README "DPO"): it loads with a model folder as init.from (its config.json
fills [model]), trains with train.objective = "dpo" on a layout DPO takes, and the DPO checks
refuse what DPO does not run on yet, naming the key."""
import pytest

from hpctrain import config
from hpctrain.errors import ConfigError
from hpctrain.train.dpo import check_dpo_config
from hpctrain.train.model_setup import size_error
from tests.conftest import ROOT
from tests.hf_configs import LLAMA31_8B, write_config_folder

RECIPE = ROOT / "configs" / "dpo.toml"
# a 1B-shaped Llama folder (Llama-3.2-1B-Instruct's shape): what a DPO recipe aligns on a node
LLAMA_1B = {**LLAMA31_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "tie_word_embeddings": True}


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # init.from's relative path: models/sft
    write_config_folder(tmp_path / "models" / "sft", LLAMA_1B)
    return lambda *overrides: config.load(str(RECIPE), list(overrides))


def test_recipe_loads_as_dpo_on_the_folders_model(recipe):
    cfg = recipe()
    assert (cfg.train.objective, cfg.dpo.beta, cfg.dpo.loss_type) == ("dpo", 0.1, "sigmoid")
    assert (cfg.model.arch, cfg.model.n_layer, cfg.model.n_embd, cfg.model.block_size) == \
        ("llama", 16, 2048, 1024)
    check_dpo_config(cfg)
    assert size_error(cfg.model, 8 * 80 * 10 ** 9, "1 node") is None


@pytest.mark.parametrize("override, key", [
    ("--parallel.tp=2", "parallel.tp"), ("--parallel.data_parallel=fsdp", "parallel.data_parallel"),
    ("--sync.mode=diloco", "sync.mode"), ("--train.loss_chunk=1024", "train.loss_chunk"),
    ("--dpo.beta=0", "dpo.beta")])
def test_what_dpo_does_not_run_on_is_refused_naming_the_key(recipe, override, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        check_dpo_config(recipe(override))


def test_named_eval_sets_are_refused_with_dpo(recipe):
    """[[eval]] sets measure the next-token loss, not DPO's: refused naming the first table."""
    from hpctrain.config_schema import EvalSetConfig

    cfg = recipe()
    cfg.eval = [EvalSetConfig(name="held_out", data="data/prefs")]
    with pytest.raises(ConfigError, match=r"config key 'eval\[0\].name'.*'held_out'"):
        check_dpo_config(cfg)
