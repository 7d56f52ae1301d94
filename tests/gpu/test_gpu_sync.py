"""DiLoCo and checkpoints on GPUs (shared/GPU.md items 5, 8, 9): an overlapped DiLoCo run on two
GPUs (its averages on a Gloo group over host copies, never NCCL from the pool thread) learns and
ends with every replica equal; an async-saved run resumes onto the straight run's curve. Skipped,
with the reason, without CUDA (or with fewer than two GPUs for the two-rank test)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import TINY_TRAIN, mpirun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]


def train(tmp_path, dataset, ranks, name, steps, *overrides):
    run = tmp_path / name
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(TINY_TRAIN.format(run=run, data=dataset, steps=steps))
    r = mpirun(ranks, ["-m", "hpctrain", "train", "--config", cfg, "--dist.backend=nccl",
                       "--train.tf32=false", *overrides], timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x["loss"] for x in recs if "loss" in x}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_diloco_overlap_on_two_gpus_learns(tmp_path, dataset):
    losses = train(tmp_path, dataset, 2, "overlap", 60, "--sync.mode=diloco", "--sync.inner_steps=2",
                   "--sync.overlap=true", "--checkpoint.interval=1000")
    assert max(losses) == 60 and losses[60] < losses[1] - 0.5, losses


def test_async_save_resumes_onto_the_straight_curve(tmp_path, dataset):
    straight = train(tmp_path, dataset, 1, "straight", 8, "--checkpoint.interval=4")
    train(tmp_path, dataset, 1, "resumed", 8, "--checkpoint.interval=4", "--checkpoint.async=true",
          "--train.stop_at_step=4")
    resumed = train(tmp_path, dataset, 1, "resumed", 8, "--checkpoint.interval=4",
                    "--checkpoint.async=true")
    assert resumed == straight
