"""Named validation sets during training (#53, `[[eval]]` tables) under a real 2-rank mpiexec.

PARITY_GPT on 2 data-parallel ranks, 20 steps, with two sets: `plays` (the training dataset's val
split, every 5 steps) and `speeches` (another dataset of the same tokenizer, every 10 steps, 2
micro-batches and at most 12 windows' tokens). Their metrics must equal what `hpctrain eval`
measures on the same checkpoint and windows, and training must not move by a bit for them."""
from __future__ import annotations

import json
import math
import sys

import pytest

from tests.conftest import losses, mpirun, records
from tests.helpers import PARITY_GPT, shared_layout_run, train
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi
DP2 = ["--train.grad_accum=1"]  # the "dp2" layout of tests/helpers.py: global batch 8
BLOCK, MICRO, EVAL_BATCHES = 32, 4, 8  # PARITY_GPT's block and micro-batch, train.eval_batches' default
SPEECH_WINDOWS = 12  # max_tokens = 12 windows: 3 per micro-batch x 2 micro-batches x 2 ranks
EVAL_TABLES = """
[[eval]]
name = "plays"
data = "{plays}"
interval = 5

[[eval]]
name = "speeches"
data = "{speeches}"
interval = 10
max_batches = 2
max_tokens = {max_tokens}
"""


def write_config(out, name, dataset, speeches):
    run = out / name
    cfg = out / f"{name}.toml"
    cfg.write_text(PARITY_GPT.format(run=run, data=dataset) + EVAL_TABLES.format(
        plays=dataset, speeches=speeches, max_tokens=SPEECH_WINDOWS * BLOCK))
    return cfg, run


@pytest.fixture(scope="module")
def named(tmp_path_factory, dataset, speeches):
    """The 20-step run with both sets (checkpoints at 10 and 20), once a session."""
    def build(out):
        cfg, _ = write_config(out, "named", dataset, speeches)
        train(2, cfg, *DP2, timeout=600)
    return shared_dir(tmp_path_factory, "named_evals", build) / "named"


def evaluate(run, data, windows, step) -> dict:
    r = mpirun(2, ["-m", "hpctrain", "eval", str(run), "--data", str(data), "--windows",
                   str(windows), "--step", str(step), "--json"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_each_set_is_reported_at_its_steps(named):
    plays, speeches = losses(named, "eval/plays/loss"), losses(named, "eval/speeches/loss")
    assert sorted(plays) == [5, 10, 15, 20] and sorted(speeches) == [10, 20]
    assert sorted(losses(named, "eval/plays/bpb")) == [5, 10, 15, 20]
    assert plays[20] < plays[5] - 0.2, plays  # the model learns: the set's loss falls
    assert not losses(named, "val_loss")  # train.eval_interval = 0: the val split stays off


@pytest.mark.parametrize("name, data, windows, step", [
    ("plays", "dataset", MICRO * EVAL_BATCHES * 2, 20),  # 8 micro-batches x 4 x 2 ranks
    ("speeches", "speeches", SPEECH_WINDOWS, 10)])  # many end-of-text tokens: bytes < tokens
def test_a_set_equals_hpctrain_eval_on_its_checkpoint(named, request, name, data, windows, step):
    """`hpctrain eval` of the checkpoint at `step` over the same windows (K spread evenly over the
    split) gives the loss and bits per byte the run logged for the set at that step (a wrong
    window choice, a rank's share lost, max_tokens or max_batches ignored, or bytes miscounted
    move them by far more than 1e-5)."""
    got = evaluate(named, request.getfixturevalue(data), windows, step)
    assert got["windows"] == windows and got["step"] == step and got["bytes_method"] == "token bytes"
    loss, bpb = losses(named, f"eval/{name}/loss")[step], losses(named, f"eval/{name}/bpb")[step]
    assert abs(got["loss"] - loss) <= 1e-5 * loss, (got["loss"], loss)
    assert abs(got["bits_per_byte"] - bpb) <= 1e-5 * bpb, (got["bits_per_byte"], bpb)
    assert got["bytes"] < got["tokens"] if name == "speeches" else got["bytes"] <= got["tokens"]
    assert got["bits_per_byte"] == pytest.approx(got["nats"] / math.log(2) / got["bytes"], rel=1e-12)


def test_training_numbers_are_those_without_the_sets(named, tmp_path_factory, dataset):
    """The same layout without [[eval]] (test_parallel_parity's dp2 run): bit-equal losses."""
    _, plain = shared_layout_run(tmp_path_factory, dataset, "dp2")
    ours, theirs = losses(named), losses(plain)
    assert sorted(ours) == list(range(1, 21)) and ours == theirs


def test_resume_with_the_sets_is_bit_exact(named, tmp_path, dataset, speeches):
    """Stopped at step 10 and resumed: every loss and every set's metric as in the straight run."""
    cfg, run = write_config(tmp_path, "resumed", dataset, speeches)
    train(2, cfg, *DP2, "--train.stop_at_step=10", timeout=600)
    assert sorted(losses(run)) == list(range(1, 11))
    train(2, cfg, *DP2, timeout=600)
    keys = ["loss", "eval/plays/loss", "eval/plays/bpb", "eval/speeches/loss", "eval/speeches/bpb"]
    for key in keys:
        assert losses(run, key) == losses(named, key), key
    assert len([r for r in records(run) if "eval/speeches/loss" in r]) == 2  # 10 once, 20 once
