"""train.precision = "fp16" under a real mpiexec: dynamic loss scaling (torch.amp.GradScaler) agreed by
every rank, overflow steps skipped and counted, the scaler's state in checkpoints (exact resume), and
the layouts where gradients are sharded (FSDP) or split by stage (PP)."""
import math

import pytest

from tests.conftest import losses, records
from tests.helpers import copy_run_at, train, write_config

pytestmark = pytest.mark.mpi

FAST = ("--train.steps=12", "--train.eval_interval=0", "--checkpoint.interval=100",
        "--train.warmup_steps=2")


def test_fp16_trains_like_fp32_and_reports_its_loss_scale(tmp_path, dataset):
    runs = {}
    for precision in ("fp32", "fp16"):
        cfg, run = write_config(tmp_path, dataset, name=precision)
        train(2, cfg, *FAST, f"--train.precision={precision}")
        runs[precision] = losses(run)
    assert runs["fp16"].keys() == runs["fp32"].keys() == set(range(1, 13))
    # the same model and data: fp16 autocast stays within a few hundredths of fp32, and learns
    assert all(abs(runs["fp16"][s] - runs["fp32"][s]) < 0.05 for s in runs["fp32"]), runs
    assert runs["fp16"][12] < runs["fp16"][1] - 0.5
    recs = records(tmp_path / "fp16")
    assert {r["loss_scale"] for r in recs if "loss" in r} == {65536.0}
    assert recs[-1]["overflow_steps"] == 0


def test_overflow_steps_are_skipped_counted_and_shrink_the_scale(tmp_path, dataset):
    """A scale of 2^28 overflows the fp16 gradients: those steps are skipped on both ranks (the
    weights do not move, no bad-step error), the scale halves each time until steps go through."""
    cfg, run = write_config(tmp_path, dataset)
    train(2, cfg, *FAST, "--train.steps=20", "--train.precision=fp16",
          f"--train.loss_scale_init={2.0 ** 28}", "--train.max_bad_steps=2")
    recs = [r for r in records(run) if "loss" in r]
    over = [r["step"] for r in recs if r["overflow"]]
    k = len(over)
    assert 2 <= k <= 14 and over == list(range(1, k + 1)), over
    assert recs[-1]["overflow_steps"] == k
    scales = [r["loss_scale"] for r in recs]  # each record: the scale after that step's update
    assert scales[:k] == [2.0 ** (27 - i) for i in range(k)] and scales[k] == scales[k - 1], scales
    # skipped steps leave the weights as they were: the next batch's loss is still ~ln(257)
    assert all(abs(recs[i]["loss"] - math.log(257)) < 0.3 for i in range(k + 1))
    assert recs[-1]["loss"] < recs[k]["loss"] - 0.3  # then it learns
    assert not any(r.get("skipped") for r in recs)  # not counted as non-finite (bad) steps


@pytest.mark.parametrize("layout", [(), ("--parallel.data_parallel=fsdp",),
                                    ("--parallel.pp=2", "--train.grad_accum=2", "--train.micro_batch_size=2")],
                         ids=["ddp", "fsdp", "pp"])
def test_fp16_resume_is_exact_with_the_scaler_state(tmp_path, dataset, layout):
    """Resume from step 6 (the uninterrupted run's checkpoint, tests/helpers.py copy_run_at): the
    same losses and loss scales as that run; the growth interval of 2 makes the scale change across
    the resume (its counter must be restored)."""
    common = (*FAST, "--train.precision=fp16", "--train.loss_scale_growth_interval=2", *layout,
              "--checkpoint.interval=6")
    cfg, whole = write_config(tmp_path, dataset, name="whole")
    train(2, cfg, *common)
    cfg, parts = write_config(tmp_path, dataset, name="parts")
    copy_run_at(whole, parts, 6)
    r = train(2, cfg, *common)
    assert "resumed from" in r.stderr and "step_00000006" in r.stderr
    assert losses(parts) == losses(whole)
    scale = {r["step"]: r["loss_scale"] for r in records(whole) if "loss" in r}
    assert {r["step"]: r["loss_scale"] for r in records(parts) if "loss" in r} == scale
    assert len(set(scale.values())) >= 3, scale  # grew across the stop
