"""Config keys of issue 6 (async checkpoints, heartbeat, bad-step policy): the `async` spelling, defaults,
validation naming the key, and --help listing them; the bad-step policy's counting in one process."""
from __future__ import annotations

import pytest
import torch

from hpctrain import config
from hpctrain.errors import ConfigError

BASE = {"run": {"dir": "r"}, "data": {"path": "d"},
        "model": {"n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 8, "vocab_size": 16},
        "train": {"steps": 20, "micro_batch_size": 1}}


def build(**sections):
    raw = {k: dict(v) for k, v in BASE.items()}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config.from_dict(raw, "test.toml")


def test_defaults_and_async_spellings():
    c = build()
    assert (c.checkpoint.async_save, c.checkpoint.full_checksums) == (False, True)
    assert (c.dist.heartbeat_timeout_s, c.train.max_bad_steps, c.debug.inject_nan_at_step) == (60.0, 5, 0)
    assert build(checkpoint={"async": True}).checkpoint.async_save is True
    assert build(checkpoint={"async_save": True}).checkpoint.async_save is True
    over = config.parse_overrides(["--checkpoint.async=true"])
    assert build(**over).checkpoint.async_save is True


@pytest.mark.parametrize("section, key, value", [
    ("train", "max_bad_steps", 0), ("debug", "inject_nan_at_step", -1), ("debug", "delay_s", -0.5),
    ("dist", "heartbeat_timeout_s", -1.0)])
def test_bad_values_name_the_key(section, key, value):
    with pytest.raises(ConfigError, match=f"config key '{section}.{key}'"):
        build(**{section: {key: value}})


def test_a_moved_test_only_key_names_its_new_place():
    with pytest.raises(ConfigError, match=r"'train.inject_nan_at_step'.*'debug.inject_nan_at_step'"):
        build(train={"inject_nan_at_step": 3})
    assert build(debug={"inject_nan_at_step": 3}).debug.inject_nan_at_step == 3


def test_help_lists_the_keys():
    text = config.describe()
    for key in ("--checkpoint.async_save", "--checkpoint.full_checksums", "--dist.heartbeat_timeout_s",
                "--train.max_bad_steps", "--debug.inject_nan_at_step"):
        assert key in text
    assert "TEST ONLY" in text


def test_bad_step_policy_skips_counts_and_stops():
    from hpctrain.train.bad_steps import BadStepPolicy, TrainingDivergedError

    g = BadStepPolicy(max_bad_steps=2, inject_nan_at_step=3, rank=0, world_size=1)
    one = torch.tensor(1.0)
    assert torch.isnan(g.poison(3, one)) and g.poison(4, one) == one
    assert g.should_skip(1, one, 0.5) is False
    assert g.should_skip(2, one, float("inf")) is True
    assert g.should_skip(3, one, 0.5) is False and g.in_a_row == 0 and g.skipped == 1
    assert g.should_skip(4, torch.tensor(float("nan")), 0.5) is True
    with pytest.raises(TrainingDivergedError, match=r"2 steps in a row \(steps 4..5, train.max_bad_steps=2\)"):
        g.should_skip(5, one, float("nan"))


def test_an_mpi_error_counts_as_a_failed_collective_that_waits_for_the_heartbeat_verdict():
    """The CPU gradient all-reduce is an MPI call: when a peer is SIGKILLed, MPICH may fail it
    before the heartbeat is overdue. watch_peers must treat that like a gloo error (wait for the
    watchdog to name the lost rank), not let a traceback through (a race seen in CI)."""
    import subprocess
    import sys

    code = ("from mpi4py import MPI\n"
            "from hpctrain.distributed.watchdog import _is_comm_error as c\n"
            "print(c(MPI.Exception(MPI.ERR_OTHER)), c(ValueError('x')), c(RuntimeError('boom')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "False", "False"], out.stderr[-2000:]
