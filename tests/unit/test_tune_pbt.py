"""PBT's pure parts: the [tune.pbt] table, explore within bounds, the exploit plan, the explorer's
RNG state through JSON, the population's state, and the lineage file's truncation on resume."""
from __future__ import annotations

import json
import math
import random
import sys

import pytest

from hpctrain.errors import ConfigError
from hpctrain.tune import pbt_space, space
from hpctrain.tune.pbt import LineageLog, Population
from hpctrain.tune.space import Param, parse
from tests.conftest import run_cmd

PARAMS = (Param("train.lr", "log_uniform", 1e-4, 1e-2), Param("train.weight_decay", "uniform", 0.0, 0.2),
          Param("train.warmup_steps", "int", 0, 40, step=10), Param("train.beta2", "choice",
                                                                    choices=(0.95, 0.98, 0.99)))


def tune_table(**pbt):
    return {"params": {"train": {"lr": {"log_uniform": [1e-4, 1e-2]}}}, "pbt": pbt}


def test_pbt_table_defaults_and_overrides():
    assert space.parse_pbt(None) == space.PbtConfig()
    got = space.parse_pbt({"population": "8", "ready": 10, "perturb": [0.5, 2], "exploit": "false"})
    assert (got.population, got.ready, got.perturb, got.exploit) == (8, 10, (0.5, 2.0), False)
    assert got.n_exchanged() == 0  # exploit off: a baseline of fixed members
    assert [space.PbtConfig(population=p).n_exchanged() for p in (1, 2, 3, 4, 8, 10)] == [0, 1, 1, 1, 2, 2]


@pytest.mark.parametrize("table,key", [({"ready": 0}, "tune.pbt.ready"),
                                       ({"quantile": 0.7}, "tune.pbt.quantile"),
                                       ({"perturb": [0.8, -1]}, "tune.pbt.perturb"),
                                       ({"resample_probability": 2}, "tune.pbt.resample_probability"),
                                       ({"speed": 1}, "tune.pbt.speed")])
def test_bad_pbt_keys_are_named(table, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        parse(tune_table(**table))


def test_pbt_overrides_fold_into_the_table():
    raw = {**tune_table(ready=5), "pbt.population": "2"}
    parse(raw)  # no "unknown key 'tune.pbt.population'"
    from hpctrain.tune.space import fold_pbt_overrides

    assert fold_pbt_overrides(raw)["pbt"] == {"ready": 5, "population": "2"}


def test_only_keys_the_trainer_rereads_can_be_tuned():
    tune = parse({"params": {"train": {"lr": {"log_uniform": [1e-4, 1e-2]},
                                       "micro_batch_size": {"choice": [4, 8]}}}})
    with pytest.raises(ConfigError, match="'tune.params.train.micro_batch_size': PBT cannot change"):
        pbt_space.check_mutable(tune)


def within(p: Param, v) -> bool:
    if p.kind == "choice":
        return v in p.choices
    if p.kind == "int":
        return isinstance(v, int) and p.low <= v <= p.high and (v - p.low) % p.step == 0
    return isinstance(v, float) and p.low <= v <= p.high


@pytest.mark.parametrize("resample", [0.0, 0.25, 1.0])
def test_explore_stays_within_bounds_over_many_draws(resample):
    rng, cfg = random.Random(7), space.PbtConfig(resample_probability=resample, perturb=(0.5, 0.8, 1.2, 3.0))
    values = pbt_space.first_values(PARAMS, 1, rng)[0]
    seen = {p.key: set() for p in PARAMS}
    for _ in range(3000):
        values = pbt_space.explore(PARAMS, values, rng, cfg)
        for p in PARAMS:
            assert within(p, values[p.key]), (p, values[p.key])
            seen[p.key].add(values[p.key])
    # perturbing reaches both bounds (clipped, not rejected); every grid point / choice is visited
    lr = seen["train.lr"]
    if resample < 1:
        assert min(lr) == 1e-4 and max(lr) == 1e-2
    else:
        assert 1e-4 < min(lr) < 2e-4 and 0.5e-2 < max(lr) < 1e-2
    assert seen["train.warmup_steps"] == {0, 10, 20, 30, 40}
    assert seen["train.beta2"] == {0.95, 0.98, 0.99}


def test_perturb_moves_by_a_factor_and_choices_to_a_neighbour():
    rng = random.Random(0)
    lr, wd, warm, beta2 = PARAMS
    got = {pbt_space.perturb(lr, 1e-3, rng, (0.8, 1.2)) for _ in range(200)}
    assert sorted(got) == pytest.approx([8e-4, 1.2e-3])
    assert {pbt_space.perturb(beta2, 0.98, rng, (0.8, 1.2)) for _ in range(200)} == {0.95, 0.99}
    assert {pbt_space.perturb(beta2, 0.95, rng, (0.8, 1.2)) for _ in range(50)} == {0.98}
    assert {pbt_space.perturb(warm, 20, rng, (0.8, 1.2)) for _ in range(200)} == {10, 30}  # a step
    assert {pbt_space.perturb(warm, 0, rng, (0.8, 1.2)) for _ in range(200)} == {0, 10}  # clipped
    assert {pbt_space.perturb(warm, 40, rng, (0.5, 2.0)) for _ in range(200)} == {20, 40}


def test_exploit_plan_worst_quarter_copies_best_quarter():
    losses = [3.0, 1.0, math.nan, 2.0, 0.5, 4.0, 2.5, 1.5]
    plan = pbt_space.exploit_plan(losses, space.PbtConfig(population=8), random.Random(1))
    assert [loser for loser, _ in plan] == [2, 5]  # NaN ranks last
    assert all(donor in (4, 1) for _, donor in plan)
    off = space.PbtConfig(population=8, exploit=False)
    assert pbt_space.exploit_plan(losses, off, random.Random(1)) == []


def test_same_seed_same_lineage_and_rng_survives_json():
    tune = parse({"params": {"train": {"lr": {"log_uniform": [1e-4, 1e-2]},
                                       "warmup_steps": {"int": [0, 40], "step": 10}}}})
    cfg = space.PbtConfig(population=4, seed=3)
    a, b = Population(tune, cfg), Population(tune, cfg)
    a.next_round(4, [1.0, 2.0, 3.0, 4.0])
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # as a checkpoint holds it
    assert a.next_round(8, [4.0, 3.0, 2.0, 1.0]) == b.next_round(8, [4.0, 3.0, 2.0, 1.0])
    _, records = a.next_round(12, [1.0, 1.0, 5.0, 1.0])
    exploit = records[1]
    assert (exploit["member"], exploit["round"], exploit["step"]) == (2, 3, 12)
    assert a.values[2] == exploit["new"] and exploit["donor"] == a.values[exploit["copied_from"]]
    with pytest.raises(ConfigError, match="'tune.pbt.population': 2, but the checkpoint holds 4"):
        Population(tune, space.PbtConfig(population=2)).load_state_dict(a.state_dict())


def test_lineage_drops_records_after_the_resumed_step(tmp_path):
    log = LineageLog(tmp_path / "lineage.jsonl", True, 0)
    for step in (0, 4, 8, 12):
        log.write({"step": step})
    LineageLog(tmp_path / "lineage.jsonl", True, 8)
    assert [json.loads(x)["step"] for x in (tmp_path / "lineage.jsonl").read_text().splitlines()] == [0, 4, 8]


def test_member_config_gives_each_member_its_own_folders(monkeypatch):
    from hpctrain import config
    from hpctrain.tune.pbt import member_config

    monkeypatch.setenv("TMPDIR", "/scratch/tmp")
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    model = ["--model.n_layer=1", "--model.n_head=1", "--model.n_embd=8", "--model.block_size=8",
             "--model.vocab_size=257", "--train.steps=10", "--train.micro_batch_size=1"]
    cfg = config.load(None, ["--run.dir=/runs/p", "--data.path=/d", "--checkpoint.dir=/ck", *model])
    got = member_config(cfg, 3)
    assert (got.run.dir, got.checkpoint.dir, got.data.cache_dir) == (
        "/runs/p/member_3", "/ck/member_3", "/scratch/tmp/pbt_member_3")
    assert cfg.run.dir == "/runs/p" and cfg.data.cache_dir == "auto"  # a copy
    off = config.load(None, ["--run.dir=/runs/p", "--data.path=/d", "--data.cache_dir=off", *model])
    assert member_config(off, 0).data.cache_dir == "off"


def test_a_round_at_an_eval_step_reuses_the_step_records_validation(monkeypatch):
    """A round and the step record at the same step validate once; after the round's copy of
    weights (forget_validation) or at the next step it validates again."""
    from hpctrain.train.loop import Trainer
    from hpctrain.tune.pbt_loop import MemberTrainer

    calls = []
    monkeypatch.setattr(Trainer, "evaluate", lambda self: calls.append(self.step) or 2.5 + len(calls))
    tr = object.__new__(MemberTrainer)  # no model: only the memo is under test
    tr.step = 50
    assert (tr.evaluate(), tr.evaluate()) == (3.5, 3.5) and calls == [50]
    tr.forget_validation()
    assert tr.evaluate() == 4.5 and calls == [50, 50]
    tr.step = 51
    assert tr.evaluate() == 5.5 and calls == [50, 50, 51]


# a round's line from each of: rank 0 by default, rank 1 by default, rank 1 with HPCTRAIN_LOG_RANKS=all
ROUND_LINES = """
import os
from hpctrain import logs
from hpctrain.tune.pbt_loop import log_round
for rank, ranks in ((0, "0"), (1, "0"), (1, "all")):
    os.environ["HPCTRAIN_LOG_RANKS"] = ranks
    logs.setup(rank, 2)
    log_round(4, 1, [5.541, 5.239], [(0, 1)])
"""


def test_a_rounds_line_is_logged_as_every_log_line():
    """The round's line goes through hpctrain's logging (stderr; stdout is a command's output):
    rank 0's bare, as the line it printed before; another rank's only when asked for, prefixed."""
    line = "[pbt] step 4 round 1: val losses 5.5410 5.2390; best member 1; copies 0<-1"
    r = run_cmd([sys.executable, "-c", ROUND_LINES], timeout=120)
    assert (r.returncode, r.stdout) == (0, ""), r.stdout + r.stderr
    assert r.stderr.splitlines() == [line, f"[rank 1] {line}"]
