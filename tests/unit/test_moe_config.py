"""MoE in the config (#34): a [model.moe] table or model.moe_* keys, overrides, one-line errors."""
from __future__ import annotations

import dataclasses

import pytest

from hpctrain import config
from hpctrain.errors import ConfigError
from hpctrain.model import build_model_from_section
from hpctrain.model.moe import MoEFeedForward
from tests.conftest import model_section

BASE = """[run]
dir = "/tmp/x"
[data]
path = "/tmp/d"
""" + model_section(arch="{arch}", n_layer=4, n_head=4, block_size=32,
                    vocab_size=300) + """{model}
[train]
steps = 4
warmup_steps = 0
micro_batch_size = 2
"""
TABLE = "[model.moe]\nexperts = 4\ntop_k = 1\nshared_experts = 1\nevery = 2\ngate = \"sigmoid\"\nbias_update_rate = 0.001"


def _load(tmp_path, model="", arch="llama", overrides=()):
    path = tmp_path / "c.toml"
    text = BASE.format(arch=arch, model=("multiple_of = 32\n" if arch == "llama" else "")
                       + ("" if model.startswith("[") else model))
    path.write_text(text + ("\n" + model if model.startswith("[") else ""))
    return config.load(path, list(overrides))


def test_the_moe_table_builds_sparse_layers(tmp_path):
    cfg = _load(tmp_path, TABLE)
    assert (cfg.model.moe_experts, cfg.model.moe_top_k, cfg.model.moe_every) == (4, 1, 2)
    model = build_model_from_section(dataclasses.asdict(cfg.model))
    sparse = [i for i, b in model.blocks.items() if isinstance(b.mlp, MoEFeedForward)]
    assert sparse == ["1", "3"]
    moe = model.blocks["1"].mlp.cfg
    assert (moe.gate, moe.n_shared_experts, moe.bias_update_rate) == ("sigmoid", 1, 0.001)
    assert "moe_experts = 4" in config.to_toml(cfg)  # config.toml: the flat keys, read back equal
    (tmp_path / "back.toml").write_text(config.to_toml(cfg))
    assert config.load(tmp_path / "back.toml").model == cfg.model


def test_an_override_wins_and_a_key_given_twice_is_named(tmp_path):
    assert _load(tmp_path, TABLE, overrides=["--model.moe_top_k=2"]).model.moe_top_k == 2
    with pytest.raises(ConfigError, match=r"model\.moe\.top_k"):
        _load(tmp_path, "moe_top_k = 2\n" + TABLE.replace("[model.moe]\n", "[model.moe]\n"))


@pytest.mark.parametrize("overrides,key", [
    (["--model.moe_top_k=5"], "model.moe_top_k"),
    (["--model.moe_every=0"], "model.moe_every"),
    (["--model.moe_first_dense=4"], "model.moe_first_dense"),
])
def test_bad_values_name_their_key(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _load(tmp_path, TABLE, overrides=overrides)


def test_gpt2_refuses_moe_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.moe_experts"):
        _load(tmp_path, arch="gpt2", overrides=["--model.moe_experts=4"])
