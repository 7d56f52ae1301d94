"""Per-layer MoE metrics and the hot-expert warning (hpctrain/train/moe_monitor.py, #34)."""
from __future__ import annotations

import logging
import re

import pytest
import torch

from hpctrain import config
from hpctrain.errors import ConfigError
from hpctrain.train.moe_monitor import MoEMonitor, monitor_for
from hpctrain.model.llama import Llama, LlamaConfig
from hpctrain.model.moe import MoEConfig
from tests.conftest import model_section


def _model(**moe) -> Llama:
    torch.manual_seed(0)
    cfg = LlamaConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, multiple_of=16,
                      moe=MoEConfig(n_experts=4, top_k=2, **moe))
    model = Llama(cfg)
    with torch.no_grad():
        for block in model.blocks.values():  # every token makes the same choice
            block.mlp.router.weight.zero_()
            block.mlp.router.weight[3] += 1.0
    return model


def _tokens() -> torch.Tensor:
    return torch.full((2, 16), 5)  # one token id: the same hidden state, the same choice


def test_each_layer_reports_its_load_and_a_hot_expert_is_warned_once(caplog):
    model = _model(aux_loss_coef=0.01)
    monitor = MoEMonitor(model, warn_ratio=1.5, warn_steps=3)
    recs = []
    with caplog.at_level(logging.WARNING, logger="hpctrain.moe"):
        for step in range(1, 6):
            model(_tokens()).float().mean().backward()
            recs.append(monitor.after_step(step))
    rec = recs[-1]
    for layer in ("0", "1"):
        load = rec[f"moe.{layer}.load"]
        assert sum(load) == 2 * 16 * 2 and sorted(load) == [0, 0, 32, 32]  # one choice for all
        assert rec[f"moe.{layer}.max_mean"] == 32 / 16
        assert rec[f"moe.{layer}.aux_loss"] > 1.0 and 0 <= rec[f"moe.{layer}.entropy"] <= torch.log(torch.tensor(4.0))
    warnings = [r.getMessage() for r in caplog.records if "MoE layer" in r.getMessage()]
    assert len(warnings) == 2 and all("step 3" in w for w in warnings)  # one per layer, at step 3
    hot = rec["moe.0.load"].index(32)
    assert f"expert {hot} " in warnings[0]


def test_bias_step_is_taken_from_the_loads_and_reported():
    model = _model(gate="sigmoid", bias_update_rate=0.1)
    monitor = MoEMonitor(model)
    with torch.no_grad():
        model(_tokens())
    rec = monitor.after_step(1)
    load = torch.tensor(rec["moe.0.load"], dtype=torch.float32)
    bias = model.blocks["0"].mlp.router.bias
    assert torch.equal(bias, 0.1 * torch.sign(load.mean() - load))  # hot experts pushed down
    assert abs(rec["moe.0.bias_spread"] - 0.2) < 1e-6
    assert monitor.after_step(2)["moe.0.load"] == [0, 0, 0, 0]  # loads are read once


WARN_CONFIG = """[run]
dir = "{run}"
[data]
path = "{run}"
""" + model_section(arch="llama", n_head=4, n_embd=32, block_size=16, vocab_size=64, multiple_of=16,
                    moe={"experts": 4}) + """{warn}
[train]
steps = 4
warmup_steps = 0
micro_batch_size = 2
"""


@pytest.mark.parametrize("warn,key", [("warn_ratio = 1.0", "model.moe_warn_ratio"),
                                      ("warn_steps = 0", "model.moe_warn_steps")])
def test_warning_keys_are_validated_naming_the_key(tmp_path, warn, key):
    path = tmp_path / "c.toml"
    path.write_text(WARN_CONFIG.format(run=tmp_path, warn=warn))
    with pytest.raises(ConfigError, match=re.escape(f"'{key}'")):
        config.load(path, [])
    path.write_text(WARN_CONFIG.format(run=tmp_path, warn="warn_ratio = 2.5\nwarn_steps = 7"))
    m = config.load(path, []).model
    assert (m.moe_warn_ratio, m.moe_warn_steps) == (2.5, 7)


def test_a_dense_model_gets_no_monitor():
    dense = Llama(LlamaConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, multiple_of=16))
    assert monitor_for(dense, None, None, True) is None  # no hook, no collective, no keys


def test_tensorboard_shows_each_layer_under_moe_and_one_scalar_per_expert():
    from hpctrain.metrics.tensorboard import scalars

    got = dict(scalars({"step": 3, "loss": 2.0, "moe.1.max_mean": 2.5, "moe.1.entropy": 1.2,
                        "moe.1.load": [10, 0, 5, 5, 0, 0, 0, 20, 0, 0, 0, 0]}))
    assert got["moe/1/max_mean"] == 2.5 and got["moe/1/entropy"] == 1.2 and got["train/loss"] == 2.0
    loads = {k: v for k, v in got.items() if k.startswith("moe/1/load/")}
    assert len(loads) == 12 and loads["moe/1/load/expert_07"] == 20 / (40 / 12)  # load / mean
    assert loads["moe/1/load/expert_00"] == 10 / (40 / 12) and loads["moe/1/load/expert_11"] == 0.0


def test_layer_names_are_the_block_numbers_under_activation_checkpointing_and_compile():
    from hpctrain.parallel.activation import apply_activation_checkpointing

    model = _model()
    apply_activation_checkpointing(model, "full", 1)
    model.blocks["1"] = torch.compile(model.blocks["1"])  # the name gains _orig_mod. (not run)
    names = [n for n, m in model.named_modules() if type(m).__name__ == "MoEFeedForward"]
    assert any("_checkpoint_wrapped_module" in n for n in names) and any("_orig_mod" in n for n in names), names
    assert sorted(MoEMonitor(model).layers) == ["0", "1"]


def test_between_log_steps_the_bias_steps_and_the_warning_counts_on_the_device(caplog):
    """log_interval 4 (#49: read on the host at log steps only): no record at steps 1-3, yet
    the bias moves every step and the hot streak is counted; at step 4 one warning per layer
    for the 4-step streak, none at step 8 (the same streak), and one again for a new streak."""
    model = _model(gate="sigmoid", bias_update_rate=0.1)
    monitor = MoEMonitor(model, warn_ratio=1.5, warn_steps=3, log_interval=4)
    bias = model.blocks["0"].mlp.router.bias
    recs, biases = {}, []
    with caplog.at_level(logging.WARNING, logger="hpctrain.moe"):
        for step in range(1, 9):
            with torch.no_grad():
                model(_tokens())
            recs[step] = monitor.after_step(step)
            biases.append(bias.detach().clone())
        warned_by_step8 = [r.getMessage() for r in caplog.records if "MoE layer" in r.getMessage()]
        for step in range(9, 13):  # a balanced step breaks the streak, then 3 hot ones
            if step > 9:
                with torch.no_grad():
                    model(_tokens())
            recs[step] = monitor.after_step(step)
    assert [s for s in recs if recs[s]] == [4, 8, 12]
    assert all(not torch.equal(a, b) for a, b in zip(biases, biases[1:]))  # a step each step
    assert len(warned_by_step8) == 2 and all("step 4" in w and "for 4 steps" in w for w in warned_by_step8)
    warned = [r.getMessage() for r in caplog.records if "MoE layer" in r.getMessage()]
    assert len(warned) == 4 and all("step 12" in w and "for 3 steps" in w for w in warned[2:]), warned
