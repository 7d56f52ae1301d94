"""Profiles on a GPU (issue #48 item 6): `metrics.profile_steps` records CUDA kernels as well as CPU
operators, `metrics.memory_snapshot_steps` dumps the CUDA allocator's history of those steps (a
pickle pytorch.org/memory_viz reads), and neither changes a loss. Skipped, with the reason, where
CUDA is not available (on CPUs the snapshot is refused: tests/unit/test_profiling.py)."""
from __future__ import annotations

import json
import pickle

import pytest
import torch

from tests.conftest import TINY_TRAIN, losses, mpirun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]

STEPS = 8


def train_one(tmp_path, dataset, name, *overrides):
    run = tmp_path / name
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(TINY_TRAIN.format(run=run, data=dataset, steps=STEPS))
    r = mpirun(1, ["-m", "hpctrain", "train", "--config", cfg, "--dist.backend=nccl", *overrides],
               timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run


def test_cuda_trace_and_memory_snapshot_of_steps_3_to_4(tmp_path, dataset):
    plain = train_one(tmp_path, dataset, "plain")
    run = train_one(tmp_path, dataset, "profiled", "--metrics.profile_steps=3-4",
                    "--metrics.memory_snapshot_steps=3-4")
    assert losses(run) == losses(plain) and len(losses(plain)) == STEPS
    assert sorted(p.name for p in (run / "profile").iterdir()) == [
        "memory_rank_0_steps_3-4.pickle", "rank_0_steps_3-4.json"]
    events = json.loads((run / "profile" / "rank_0_steps_3-4.json").read_text())["traceEvents"]
    cats = {e.get("cat") for e in events}
    assert {"cpu_op", "kernel"} <= cats, cats  # CPU operators and CUDA kernels
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#3", "ProfilerStep#4"}
    with open(run / "profile" / "memory_rank_0_steps_3-4.pickle", "rb") as f:
        snapshot = pickle.load(f)
    assert {"segments", "device_traces"} <= set(snapshot)
    trace = snapshot["device_traces"][0]
    assert any(e["action"] == "alloc" for e in trace) and any(e["action"] == "free_completed" for e in trace)
    assert any(fr.get("filename", "").endswith(".py") for e in trace for fr in e.get("frames", []))
