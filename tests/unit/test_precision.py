"""train.precision = "auto": the decision rule (unit) and the measurement it rests on."""
import pytest
import torch

from hpctrain import config
from hpctrain.train import precision


@pytest.mark.parametrize("given", ["fp32", "bf16", "fp16"])
def test_explicit_precisions_pass_through_unmeasured(given, monkeypatch):
    monkeypatch.setattr(precision, "bf16_speedup", lambda *a: pytest.fail("measured"))
    assert precision.resolve_precision(given, torch.device("cpu"), 384, 128) == given


@pytest.mark.parametrize("speedup, chosen", [(4.0, "bf16"), (1.31, "bf16"), (1.29, "fp32"), (0.5, "fp32")])
def test_auto_on_cpu_follows_the_measured_speedup(speedup, chosen, monkeypatch):
    seen = []
    monkeypatch.setattr(precision, "bf16_speedup", lambda *shape: seen.append(shape) or speedup)
    assert precision.resolve_precision("auto", torch.device("cpu"), 384, 128) == chosen
    assert seen == [(384, 128, 512)]  # one micro-batch of tokens x the MLP's first weight


def test_the_measurement_is_a_positive_ratio_of_real_products():
    import math  # the value depends on the chip and the load (CI shares its cores): only its form
    s = precision.bf16_speedup(384, 128, 512)
    assert math.isfinite(s) and s > 0


def test_auto_is_a_valid_config_value_and_others_are_named(root):
    recipe = root / "configs" / "recipe.toml"  # the config that uses auto
    assert config.load(recipe).train.precision == "auto"
    with pytest.raises(config.ConfigError) as e:
        config.load(recipe, ["--train.precision=int8"])
    assert "train.precision" in str(e.value) and "auto" in str(e.value)
