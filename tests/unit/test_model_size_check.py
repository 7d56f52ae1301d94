"""A model no layout of the job could hold is refused before anything is built (#47): its whole
training state (16 B per parameter, plan/shape.py) against all the job's memory, one line naming
the [model] key it grows with. Never refused: configs/*.toml at the sizes they are written for,
the test suite's configs on this machine. The `train` rows (a 10^9-layer typo, init.from's
config.json) are in test_bad_input_table.py."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from hpctrain import config
from hpctrain.config_schema import ModelConfig
from hpctrain.plan import moe
from hpctrain.plan.shape import PRESETS, STATE_BYTES_PER_PARAM, ModelShape
from hpctrain.train.model_setup import job_memory, size_error
from tests.conftest import ROOT, TINY_MODEL
from tests.helpers import PARITY_GPT, SMALL_GPT

GB = 10**9
TINY = ModelShape(n_layer=1, n_embd=32, n_head=2, vocab_size=257, block_size=32)


@pytest.mark.parametrize("typo, key", [
    ({"n_layer": 10**9}, "n_layer"), ({"n_embd": 2**24}, "n_embd"), ({"vocab_size": 10**12}, "vocab_size"),
    ({"arch": "llama", "ffn_hidden": 10**13, "n_head": 4}, "ffn_hidden"),
    ({"arch": "llama", "n_head": 4, "moe_experts": 10**9, "moe_top_k": 2}, "moe_experts")])
def test_the_key_a_size_grows_with_is_named(typo, key):
    shape = dataclasses.replace(TINY, **typo)
    assert shape.size_key() == key
    assert shape.state_bytes() == STATE_BYTES_PER_PARAM * shape.total_params()


def test_presets_state_bytes_and_sparse_layers_by_arithmetic():
    assert PRESETS["llama3-70b"].state_bytes() == 16 * 70_553_706_496
    for n_layer, every, first_dense in ((32, 1, 0), (24, 2, 0), (13, 3, 4), (5, 2, 9)):
        shape = dataclasses.replace(PRESETS["mixtral-8x7b"], n_layer=n_layer, moe_every=every,
                                    moe_first_dense=first_dense)
        assert moe.n_sparse_layers(shape) == len(moe.sparse_layers(shape))
    huge = dataclasses.replace(PRESETS["mixtral-8x7b"], n_layer=10**9)  # no 10^9-long list
    assert moe.n_sparse_layers(huge) == 10**9


def test_a_10_9_layer_typo_is_named_with_its_size():
    model = ModelConfig(n_layer=10**9, n_head=2, n_embd=32, block_size=32, vocab_size=257)
    error = size_error(model, 64 * GB, "1 node(s) x 64 GB of host memory")
    assert str(error).startswith("config key 'model.n_layer': 1000000000 makes a model of 1.27e+13 "
                                 "parameters, 185 TiB")
    error = size_error(model, 64 * GB, "...", hf_folder="/x/hf")
    assert "(num_hidden_layers of /x/hf/config.json)" not in str(error)  # gpt2: its own key
    assert "(n_layer of /x/hf/config.json)" in str(error)
    assert size_error(model, 0, "unknown") is None  # memory unknown: no check


def _toml_model(path) -> ModelConfig:
    return config.load(str(path)).model


def test_configs_and_the_test_suites_models_are_never_refused(tmp_path):
    """configs/*.toml on 4 nodes of 8 x 80 GB GPUs (llama3_70b's smallest layout), every one
    but the llama3 shapes on one node of 8 GB; the suite's TOMLs and this machine."""
    for path in sorted((ROOT / "configs").glob("*.toml")):
        if path.name in ("llama_long.toml", "dpo.toml", "lora.toml", "sft.toml"):  # init.from a model folder: their
            continue     # own tests (test_llama_long_config.py, test_dpo_recipe.py, unit/test_lora.py,
                 # test_sft_objective.py)
        model = _toml_model(path)
        assert size_error(model, 32 * 80 * GB, "4 nodes") is None, path
        if "llama3" not in path.name:
            assert size_error(model, 8 * GB, "1 node") is None, path
    have, words = job_memory(SimpleNamespace(device=torch.device("cpu"), n_nodes=1, world_size=1))
    assert have > GB and "host memory" in words
    for template in (SMALL_GPT, PARITY_GPT, "[run]\ndir = \"r\"\n[data]\npath = \"d\"\n" + TINY_MODEL
                     + "[train]\nsteps = 1\nmicro_batch_size = 1\nwarmup_steps = 0\n"):
        (tmp_path / "c.toml").write_text(template.format(run=tmp_path, data=tmp_path))
        assert size_error(_toml_model(tmp_path / "c.toml"), have, words) is None
