"""`hpctrain eval` (#53): a checkpoint's loss over a dataset split, on one rank or split over ranks.

One small byte-level GPT trained 10 steps (1 rank, fp32) with a validation at step 10 and a
checkpoint there: its logged val_loss is the reference the evaluation must reproduce from the
checkpoint alone."""
from __future__ import annotations

import json
import math
import sys

import pytest

from tests.conftest import losses, mpirun, run_cmd
from tests.helpers import train_layout
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi
MICRO, EVAL_BATCHES = 4, 8


@pytest.fixture(scope="module")
def run(tmp_path_factory, dataset):
    """The trained run dir (val_loss logged at steps 0 and 10, checkpoint at 10), once a session."""
    def build(out):
        train_layout(1, out, dataset, "r", "--train.steps=10", "--train.eval_interval=10",
                     f"--train.micro_batch_size={MICRO}", f"--train.eval_batches={EVAL_BATCHES}")
    return shared_dir(tmp_path_factory, "eval_run", build) / "r"


def evaluate(ranks: int, *args) -> dict:
    argv = ["-m", "hpctrain", "eval", *map(str, args), "--json"]
    r = mpirun(ranks, argv, timeout=300) if ranks > 1 else run_cmd([sys.executable, *argv], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_validation_windows_give_the_logged_val_loss_on_two_ranks(run, dataset):
    """Training's validation set of eval_batches x micro-batch windows, spread over the split: the
    evaluation of the step-10 checkpoint, its windows split over 2 ranks, equals the val_loss the
    run logged at step 10 (a wrong window choice, block size, target shift or loss reduction,
    or a rank's windows lost from the sum, moves it by far more)."""
    logged = losses(run, "val_loss")
    assert sorted(logged) == [0, 10] and logged[10] < logged[0] - 0.3, logged
    got = evaluate(2, run, "--data", dataset, "--windows", MICRO * EVAL_BATCHES, "--batch-size", 3)
    assert got["step"] == 10 and got["ranks"] == 2 and got["windows"] == MICRO * EVAL_BATCHES
    assert got["tokens"] == MICRO * EVAL_BATCHES * 32  # block_size 32
    assert abs(got["loss"] - logged[10]) <= 1e-5 * logged[10], (got["loss"], logged[10])
    assert got["perplexity"] == pytest.approx(math.exp(logged[10]), rel=1e-4)


def test_one_rank_equals_two_ranks_and_counts_bytes(run, speeches):
    """Another dataset of the same tokenizer, 120 windows spread over its val split: 1 rank and
    2 ranks sum the same nats; the bytes tokenizer's bytes are its predicted tokens less the
    end-of-text tokens among them (between the speeches: many). (Which windows each rank takes,
    every window included: tests/unit/test_evaluate.py.)"""
    import numpy as np

    from hpctrain.data.shards import TokenShards

    split = TokenShards(str(speeches), "val", 32)
    targets = split.batch(np.linspace(0, len(split) - 1, 120).astype(np.int64))[:, 1:]
    one = evaluate(1, run, "--data", speeches, "--windows", 120)
    two = evaluate(2, run, "--data", speeches, "--windows", 120, "--batch-size", 5)
    assert one["windows"] == two["windows"] == 120
    assert one["tokens"] == two["tokens"] == targets.numel()
    assert one["bytes"] == two["bytes"] == int((targets != 256).sum()) < targets.numel() - 20
    assert two["nats"] == pytest.approx(one["nats"], rel=1e-6)
    assert one["bytes_method"] == "token bytes"
    assert one["bits_per_byte"] == pytest.approx(one["nats"] / math.log(2) / one["bytes"], rel=1e-12)


def test_a_dataset_of_another_tokenizer_is_refused_naming_it(run, gpt2_two_plays):
    r = run_cmd([sys.executable, "-m", "hpctrain", "eval", run, "--data", gpt2_two_plays], timeout=300)
    assert r.returncode != 0 and str(gpt2_two_plays) in r.stderr and "Traceback" not in r.stderr
    assert "50257" in r.stderr  # its vocabulary, beyond the byte model's 257


def test_the_exported_hugging_face_folder_scores_as_its_checkpoint(run, dataset, tmp_path):
    """`hpctrain export` of the step-10 checkpoint, evaluated as a Hugging Face folder (weights
    through the safetensors reader, the model built from its config.json): the same val loss."""
    out = tmp_path / "hf"
    r = run_cmd([sys.executable, "-m", "hpctrain", "export", "--checkpoint", run, "--format", "hf",
                 "--output", out], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = evaluate(1, out, "--data", dataset, "--windows", MICRO * EVAL_BATCHES)
    assert got["step"] is None and got["windows"] == MICRO * EVAL_BATCHES
    logged = losses(run, "val_loss")[10]
    assert abs(got["loss"] - logged) <= 1e-5 * logged, (got["loss"], logged)
