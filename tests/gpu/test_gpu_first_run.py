"""The first run on a GPU (shared/GPU.md, "Tests to keep behind a `gpu` marker"): a 20-step run on
one GPU against the CPU reference, MFU against the detected GPU's datasheet peak, one distinct GPU
per rank and oversubscription refused. Skipped, with the reason, where CUDA is not available."""
from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import TINY_TRAIN, mpirun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]

STEPS = 20


def train_one(tmp_path, dataset, name, *overrides):
    run = tmp_path / name
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(TINY_TRAIN.format(run=run, data=dataset, steps=STEPS))
    r = mpirun(1, ["-m", "hpctrain", "train", "--config", cfg, *overrides], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return r.stdout + r.stderr, [x for x in recs if "loss" in x]


def test_ddp_on_one_gpu_matches_the_cpu_reference(tmp_path, dataset):
    _, gpu = train_one(tmp_path, dataset, "gpu", "--dist.backend=nccl", "--train.tf32=false")
    _, cpu = train_one(tmp_path, dataset, "cpu", "--dist.backend=gloo")
    assert [r["step"] for r in gpu] == [r["step"] for r in cpu] and len(gpu) == STEPS
    for g, c in zip(gpu, cpu):
        assert abs(g["loss"] - c["loss"]) <= 1e-3 * abs(c["loss"]), (g["step"], g["loss"], c["loss"])


def test_mfu_is_against_the_datasheet_peak_and_at_most_one(tmp_path, dataset):
    from hpctrain.metrics.peak import gpu_datasheet_peak

    out, recs = train_one(tmp_path, dataset, "mfu", "--dist.backend=nccl")
    name = torch.cuda.get_device_name(0)
    assert gpu_datasheet_peak(name, "tf32") is not None, f"{name} not in the datasheet table"
    assert "datasheet" in out and "(tf32 matmuls)" in out, out[-3000:]
    mfus = [r["mfu"] for r in recs if r.get("mfu") is not None]
    assert mfus and all(0 < m <= 1 for m in mfus), mfus


PROBE = """
from hpctrain.distributed import init_distributed, teardown
ctx = init_distributed("nccl", 60)
print(f"rank {ctx.rank} device {ctx.device}", flush=True)
teardown()
"""


def test_each_rank_gets_its_own_gpu(tmp_path):
    n = torch.cuda.device_count()
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    r = mpirun(n, [script], timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    devices = sorted(line.split()[-1] for line in r.stdout.splitlines() if " device cuda" in line)
    assert devices == sorted(f"cuda:{i}" for i in range(n))


def test_more_ranks_than_gpus_is_one_line(tmp_path, dataset):
    cfg = tmp_path / "over.toml"
    cfg.write_text(TINY_TRAIN.format(run=tmp_path / "over", data=dataset, steps=2))
    n = torch.cuda.device_count() + 1
    r = mpirun(n, ["-m", "hpctrain", "train", "--config", cfg, "--dist.backend=nccl"], timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "would share" in out and "Traceback" not in out, out[-3000:]
