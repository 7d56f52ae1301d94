"""`hpctrain train --dry-run N` with parallel.offload (issue 52) on FSDP2: the CUDA path of CPU
offload on fake GPU tensors. "optimizer": AdamW's state (and the host master copy and gradient
buffer) off the GPU; "all": FSDP2's CPUOffloadPolicy, shards made in host memory (meta init),
the step's numbers on the GPU, the gradient norm's all-reduce on host tensors (Gloo beside NCCL);
the peak falls, and the planner's peak follows it. Each dry run is its own process."""
from __future__ import annotations

import pytest

from tests.unit.test_dry_run import TINY_LLAMA, dry_run_json

BF16_FSDP = ["--train.precision=bf16", "--parallel.data_parallel=fsdp"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    path = tmp_path_factory.mktemp("dry_offload") / "tiny.toml"
    path.write_text(TINY_LLAMA.format(run=path.parent / "run"))
    return {mode: dry_run_json(path, 8, *BF16_FSDP, f"--parallel.offload={mode}")["ranks"][0]
            for mode in ("none", "optimizer", "all")}


def test_what_lives_on_the_gpu_and_on_the_host(reports):
    none, opt, off = reports["none"], reports["optimizer"], reports["all"]
    assert not any(none["in_host_memory"].values())
    # optimizer: moments, the fp32 master and the gradient buffer in host memory
    assert opt["optimizer"] == 0 and opt["parameters"] == none["parameters"] > 0
    assert opt["in_host_memory"]["optimizer"] == none["optimizer"] + none["parameters"] + none["gradients"]
    # all: shards, gradients and moments in host memory, none of them on the GPU
    assert off["parameters"] == off["gradients"] == off["optimizer"] == 0
    assert off["in_host_memory"] == {k: none[k] for k in ("parameters", "gradients", "optimizer")}
    assert none["peak"] > opt["peak"] > off["peak"]
    assert none["peak"] - opt["peak"] >= none["optimizer"] * 0.9


def test_the_planner_models_the_offloaded_peak(reports):
    for mode, rank in reports.items():
        assert 0.9 <= rank["peak_vs_planner"] <= 1.1, (mode, rank["peak_vs_planner"])
