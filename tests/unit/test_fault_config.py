"""Config keys of issue 6 (async checkpoints, heartbeat, bad-step policy): the `async` spelling, defaults,
validation naming the key, and --help listing them; the bad-step policy's counting in one process.
The test-only faults (issue 33): no config keys, one environment variable (hpctrain/step_faults.py);
an old [debug] key is one error naming it (an old checkpoint holding one still samples: test_train.py)."""
from __future__ import annotations

import sys

import pytest
import torch

from hpctrain import config
from hpctrain.errors import ConfigError
from tests.conftest import TINY_TRAIN, run_cmd

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
    assert (c.dist.heartbeat_timeout_s, c.dist.stall_timeout_s, c.train.max_bad_steps) == (8.0, 60.0, 5)
    assert "debug" not in c.to_dict()
    assert build(checkpoint={"async": True}).checkpoint.async_save is True
    assert build(checkpoint={"async_save": True}).checkpoint.async_save is True
    over = config.parse_overrides(["--checkpoint.async=true"])
    assert build(**over).checkpoint.async_save is True


@pytest.mark.parametrize("section, key, value", [
    ("train", "max_bad_steps", 0), ("dist", "heartbeat_timeout_s", -1.0)])
def test_bad_values_name_the_key(section, key, value):
    with pytest.raises(ConfigError, match=f"config key '{section}.{key}'"):
        build(**{section: {key: value}})


def test_an_old_test_only_key_names_the_environment_variable():
    with pytest.raises(ConfigError, match=r"'train.inject_nan_at_step'.*HPCTRAIN_TEST_FAULTS=\"inject_nan_at_step=3\""):
        build(train={"inject_nan_at_step": 3})
    with pytest.raises(ConfigError, match=r"section 'debug'.*HPCTRAIN_TEST_FAULTS=\"delay_rank=1,delay_s=0.5\""):
        build(debug={"delay_rank": 1, "delay_s": 0.5})
    with pytest.raises(ConfigError, match=r"'dist.grad_sync'.*it is now 'dist.grad_allreduce'"):
        build(dist={"grad_sync": "mpi"})


@pytest.mark.parametrize("where", ["toml", "cli"])
def test_a_debug_key_is_one_error_line_naming_the_environment_variable(tmp_path, where):
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY_TRAIN.format(run=tmp_path / "run", data=tmp_path / "no-data", steps=2)
                   + ("[debug]\ndelay_s = 1.0\n" if where == "toml" else ""))
    given = ["--debug.delay_s=1.0"] if where == "cli" else []
    r = run_cmd([sys.executable, "-m", "hpctrain", "train", "--config", cfg, *given], timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "'debug'" in lines[0] and 'HPCTRAIN_TEST_FAULTS="delay_s=1.0"' in lines[0], lines
    assert (str(cfg) in lines[0]) == (where == "toml") and not (tmp_path / "run").exists()


def test_help_lists_the_keys():
    text = config.describe()
    for key in ("--checkpoint.async_save", "--checkpoint.full_checksums", "--dist.heartbeat_timeout_s",
                "--train.max_bad_steps"):
        assert key in text
    assert "--debug." not in text and "TEST ONLY" not in text


def test_step_faults_come_from_one_environment_variable(tmp_path, monkeypatch):
    from hpctrain.step_faults import ENV, StepFaults, step_faults

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("HPCTRAIN_TUNE_TRIAL", raising=False)
    assert step_faults() == StepFaults()  # unset: every fault off
    monkeypatch.setenv(ENV, "delay_rank=1,delay_s=0.5,slow_factor=2")
    assert (step_faults().delay_rank, step_faults().delay_s, step_faults().slow_factor) == (1, 0.5, 2.0)
    faults = tmp_path / "faults"
    faults.write_text("step_sleep_s=0.25\n")
    monkeypatch.setenv(ENV, f"@{faults}")  # read from a file: a requeued job's next start
    assert step_faults().step_sleep_s == 0.25
    monkeypatch.setenv(ENV, "inject_nan_at_step=3,nan_trial=2")  # one trial of a study only
    monkeypatch.setenv("HPCTRAIN_TUNE_TRIAL", str(tmp_path / "study" / "trial_12"))
    assert step_faults().inject_nan_at_step == 0
    monkeypatch.setenv("HPCTRAIN_TUNE_TRIAL", str(tmp_path / "study" / "trial_2"))
    assert step_faults().inject_nan_at_step == 3


@pytest.mark.parametrize("raw, named", [("delay_s", "delay_s"), ("sleep=1", "sleep=1"),
                                        ("delay_s=x", "delay_s"), ("slow_factor=0.5", "slow_factor"),
                                        ("@/nonexistent/faults", "/nonexistent/faults")])
def test_a_bad_step_fault_is_one_error_naming_the_variable(monkeypatch, raw, named):
    from hpctrain.step_faults import ENV, step_faults

    monkeypatch.setenv(ENV, raw)
    with pytest.raises(ConfigError, match=ENV) as e:
        step_faults()
    assert named in str(e.value) and "\n" not in str(e.value)


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
