"""The [tune] section: parsing, one-line errors naming the key, sampled values within bounds, the
overrides a trial trains with, and the best configuration."""
from __future__ import annotations

import pytest

from hpctrain import config
from hpctrain.errors import ConfigError
from hpctrain.tune import space

BASE = {"run": {"dir": "runs/s"}, "data": {"path": "d"},
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 8, "block_size": 8, "vocab_size": 8},
        "train": {"steps": 20, "micro_batch_size": 1, "warmup_steps": 0, "eval_interval": 5}}
PARAMS = {"train": {"lr": {"log_uniform": [1e-4, 1e-2]}, "warmup_steps": {"int": [0, 10], "step": 5},
                    "micro_batch_size": {"choice": [1, 2, 4]}},
          "model.dropout": {"uniform": [0.0, 0.2]},
          "train.precision": {"choice": ["fp32", "bf16"]}}


def parse(tune: dict) -> space.TuneConfig:
    return space.parse(tune, "t.toml", run_dir="runs/s")


def test_parse_every_kind_and_defaults():
    t = parse({"n_trials": 5, "pruner": "successive_halving", "params": PARAMS})
    by_key = {p.key: p for p in t.params}
    assert sorted(by_key) == ["model.dropout", "train.lr", "train.micro_batch_size",
                              "train.precision", "train.warmup_steps"]
    assert by_key["train.lr"] == space.Param("train.lr", "log_uniform", 1e-4, 1e-2)
    assert by_key["train.warmup_steps"] == space.Param("train.warmup_steps", "int", 0, 10, step=5)
    assert by_key["train.micro_batch_size"].choices == (1, 2, 4)
    assert by_key["model.dropout"] == space.Param("model.dropout", "uniform", 0.0, 0.2)
    assert (t.n_trials, t.pruner, t.metric, t.study_name) == (5, "successive_halving", "val_loss",
                                                              "hpctrain")
    assert t.journal == "runs/s/study.journal" and str(t.trial_dir(3)) == "runs/s/trial_3"


def test_training_config_accepts_and_checks_the_section():
    cfg = config.from_dict({**BASE, "tune": {"params": PARAMS}})
    assert cfg.train.steps == 20 and "tune" not in cfg.to_dict()
    with pytest.raises(ConfigError, match=r"^config key 'tune.n_trials': must be >= 1$"):
        config.from_dict({**BASE, "tune": {"n_trials": 0, "params": PARAMS}})


@pytest.mark.parametrize("tune, key, what", [
    ({"n_trial": 3, "params": PARAMS}, "tune.n_trial", "unknown config key"),
    ({"pruner": "hyperband", "params": PARAMS}, "tune.pruner", "expected one of"),
    ({}, "tune.params", "missing config key"),
    ({"params": {"train.lrr": {"uniform": [0, 1]}}}, "tune.params.train.lrr", "not a training"),
    ({"params": {"lr": {"uniform": [0, 1]}}}, "tune.params.lr", "not a training config key"),
    ({"params": {"run.dir": {"choice": ["a", "b"]}}}, "tune.params.run.dir", "cannot be tuned"),
    ({"params": {"train.lr": {"log_uniform": [0, 1e-2]}}}, "tune.params.train.lr", "must be > 0"),
    ({"params": {"train.lr": {"uniform": [1e-2, 1e-3]}}}, "tune.params.train.lr", "must be <"),
    ({"params": {"train.lr": {"uniform": [1e-3]}}}, "tune.params.train.lr", "two numbers"),
    ({"params": {"train.lr": {"uniform": [0, 1], "int": [0, 1]}}}, "tune.params.train.lr",
     "exactly one"),
    ({"params": {"train.lr": {"uniform": [0, 1], "log": True}}}, "tune.params.train.lr",
     "unknown field 'log'"),
    ({"params": {"train.steps": {"uniform": [1, 9]}}}, "tune.params.train.steps", "use int"),
    ({"params": {"train.steps": {"int": [1, 9], "step": 3}}}, "tune.params.train.steps",
     "step 3 must be >= 1 and divide"),
    ({"params": {"train.steps": {"int": [1.5, 9]}}}, "tune.params.train.steps", "integers"),
    ({"params": {"train.precision": {"choice": ["fp32", "fp4"]}}}, "tune.params.train.precision",
     "expected one of"),
    ({"params": {"train.seed": {"choice": []}}}, "tune.params.train.seed", "non-empty list"),
    ({"params": {"train.seed": {"choice": [1, 1]}}}, "tune.params.train.seed", "repeated"),
    ({"params": {"train": {"lr": 3e-4}}}, "tune.params.train.lr", "distribution table"),
])
def test_errors_are_one_line_naming_the_key(tune, key, what):
    with pytest.raises(ConfigError) as e:
        parse(tune)
    msg = str(e.value)
    assert "\n" not in msg and f"'{key}'" in msg and what in msg, msg


def test_base_config_needs_validation_and_usr1():
    tune = parse({"params": PARAMS})
    space.check_base(config.from_dict(BASE), tune, "t.toml")
    no_eval = config.from_dict({**BASE, "train": {**BASE["train"], "eval_interval": 0}})
    with pytest.raises(ConfigError, match=r"^config key 'train.eval_interval': is 0 in t.toml"):
        space.check_base(no_eval, tune, "t.toml")
    term_only = config.from_dict({**BASE, "slurm": {"signals": "TERM"}})
    with pytest.raises(ConfigError, match=r"^config key 'slurm.signals': 'TERM' in t.toml"):
        space.check_base(term_only, tune, "t.toml")


def test_sampled_values_stay_within_bounds_and_train_as_overrides():
    optuna = pytest.importorskip("optuna")
    t = parse({"params": PARAMS})
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen = {p.key: set() for p in t.params}
    for _ in range(60):
        trial = study.ask()
        values = {p.key: p.suggest(trial) for p in t.params}
        assert 1e-4 <= values["train.lr"] <= 1e-2 and isinstance(values["train.lr"], float)
        assert values["train.warmup_steps"] in (0, 5, 10)
        assert values["train.micro_batch_size"] in (1, 2, 4)
        assert 0.0 <= values["model.dropout"] <= 0.2
        for k, v in values.items():
            seen[k].add(v)
        raw = {s: dict(d) for s, d in BASE.items()}
        for s, d in config.parse_overrides(space.overrides(values)).items():
            raw[s].update(d)
        merged = config.from_dict(raw)  # every point is a training config, its values exact
        assert merged.train.lr == values["train.lr"] and merged.model.dropout == values["model.dropout"]
        assert merged.train.precision == values["train.precision"]
        study.tell(trial, 1.0)
    assert seen["train.warmup_steps"] == {0, 5, 10} and seen["train.micro_batch_size"] == {1, 2, 4}
    lrs = sorted(seen["train.lr"])
    assert lrs[0] < 1e-3 < lrs[-1]  # log-uniform: a decade each side of the middle is reached


def test_best_configuration_is_a_training_toml(tmp_path):
    optuna = pytest.importorskip("optuna")
    from hpctrain.tune import status, study as study_mod

    base_toml = tmp_path / "base.toml"
    base_toml.write_text("\n".join(f"[{s}]\n" + "\n".join(
        f"{k} = {v!r}".replace("'", '"') for k, v in d.items()) for s, d in BASE.items()))
    t = parse({"journal": str(tmp_path / "s.journal"), "params": PARAMS})
    study = study_mod.open_study(t, {"config": str(base_toml), "toml": base_toml.read_text(),
                                     "overrides": ["--train.steps=30", "--data.cache_dir=/tmp/c_1"]})
    dist = {p.key: p for p in t.params}
    for lr, value in ((1e-3, 2.0), (5e-3, 1.5), (2e-3, 3.0)):
        study.add_trial(optuna.trial.create_trial(
            params={"train.lr": lr}, distributions={"train.lr": optuna.distributions.FloatDistribution(
                dist["train.lr"].low, dist["train.lr"].high, log=True)}, value=value))
    out = tmp_path / "best.toml"
    status.status(str(tmp_path / "s.journal"), toml_out=str(out))
    best = config.load(out)
    assert (best.train.lr, best.train.steps) == (5e-3, 30)
    assert best.run.dir == str(tmp_path / "best") and best.data.cache_dir == "auto"
    assert [r["state"] for r in status.rows(study)] == ["COMPLETE"] * 3


def test_the_example_search_config_loads():
    from hpctrain.tune.search import load
    from tests.conftest import ROOT

    cfg, tune, overrides = load(str(ROOT / "configs" / "demo_tune.toml"),
                                ["--tune.n_trials", "4", "--train.steps", "200", "--data.verify=size"])
    assert (tune.n_trials, tune.pruner, len(tune.params)) == (4, "median", 4)
    assert overrides == ["--train.steps=200", "--data.verify=size"]  # for every trial
    assert tune.journal.endswith("runs/demo_tune/study.journal") and cfg.train.steps == 200


def test_pruners_and_sampler_from_the_section():
    optuna = pytest.importorskip("optuna")
    from hpctrain.tune import study as study_mod

    kinds = {name: type(study_mod.pruner(parse({"pruner": name, "params": PARAMS})))
             for name in ("median", "successive_halving", "none")}
    assert kinds == {"median": optuna.pruners.MedianPruner,
                     "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
                     "none": optuna.pruners.NopPruner}
    assert isinstance(study_mod.sampler(parse({"params": PARAMS}), 3), optuna.samplers.TPESampler)
