"""MoE load balancing you can see (#34), in real 1-rank training runs of a tiny MoE llama
(tests/mpi/scripts/moe_train_probe.py): the loop's monitor hook writes every layer's loads to
metrics.jsonl; from a start where expert 0 is hot, DeepSeek-V3's bias balancing brings max/mean
down and without it the router collapses further; the hot-expert warning names the layer and
expert; `hpctrain plot` draws the loads as a heat map; and the auxiliary loss weighs the same per
optimizer step whatever the gradient accumulation."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import RUN_DATA, ROOT, model_section, mpiexec_path, mpirun, records, run_cmd
from tests.shared_dirs import shared_dir

PROBE = ROOT / "tests/mpi/scripts/moe_train_probe.py"
CONFIG = RUN_DATA + """verify = "size"
cache_dir = "off"
""" + model_section(arch="llama", n_embd=32, block_size=32, multiple_of=16,
                    moe={"experts": 8, "top_k": 1, "gate": "sigmoid", "warn_ratio": 2.5,
                         "warn_steps": 5}) + """[train]
steps = 40
warmup_steps = 0
micro_batch_size = 16
lr = 1e-4
eval_interval = 0
log_interval = 1
"""
STEPS = 40


@pytest.fixture(scope="module")
def skewed_runs(tmp_path_factory, one_play):
    """Two runs from the same skewed start, launched side by side: bias balancing on and off, one
    intra-op thread each (two 2-thread ranks on CI's 2 cores ran 20-30x slower per step); trained
    once per session (tests/shared_dirs.py: xdist splits the tests that read them between its
    workers), each run's stderr kept beside it as NAME.stderr."""
    def build(base):
        config = base / "moe.toml"
        config.write_text(CONFIG.format(run=base / "on", data=one_play))
        procs = {}
        for name, rate in (("on", 0.005), ("off", 0.0)):
            procs[name] = subprocess.Popen(
                [mpiexec_path(), "-n", "1", sys.executable, PROBE, "skew", config,
                 f"--model.moe_bias_update_rate={rate}", f"--run.dir={base / name}"],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env={**os.environ, "HPCTRAIN_THREADS": "1"})
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=600)
            assert proc.returncode == 0, stderr[-3000:]
            (base / f"{name}.stderr").write_text(stderr)
    base = shared_dir(tmp_path_factory, "moe_skewed_runs", build)
    return {name: (base / name, (base / f"{name}.stderr").read_text()) for name in ("on", "off")}


def max_mean(run, layer: str) -> list[float]:
    return [r[f"moe.{layer}.max_mean"] for r in records(run) if f"moe.{layer}.max_mean" in r]


def test_every_step_records_each_layers_loads(skewed_runs):
    run, _ = skewed_runs["on"]
    steps = [r for r in records(run) if "loss" in r]
    assert len(steps) == STEPS
    for rec in steps:
        for layer in ("0", "1"):
            load = rec[f"moe.{layer}.load"]
            assert len(load) == 8 and sum(load) == 16 * 32  # top_k 1: every token routed once
            assert rec[f"moe.{layer}.max_mean"] == pytest.approx(max(load) / (sum(load) / 8))
            assert 0 < rec[f"moe.{layer}.entropy"] <= np.log(8) + 1e-6
            assert rec[f"moe.{layer}.bias_spread"] >= 0
    assert "moe.0.bias_spread" not in records(skewed_runs["off"][0])[0]  # balancing off: no bias


def test_bias_balancing_brings_a_hot_expert_down_and_without_it_the_router_collapses(skewed_runs):
    for layer in ("0", "1"):
        on, off = max_mean(skewed_runs["on"][0], layer), max_mean(skewed_runs["off"][0], layer)
        assert on[0] > 2.5 and off[0] > 2.5  # the skewed start: expert 0 takes ~half the tokens
        last_on, last_off = np.mean(on[-10:]), np.mean(off[-10:])
        assert last_on < 2.0, (layer, on)  # measured: 1.65, 1.44 (layers 0, 1)
        assert last_off > 2.4, (layer, off)  # measured: 2.77, 3.56
        assert last_off - last_on > 0.8


def test_an_expert_that_stays_hot_is_warned_about_naming_layer_and_expert(skewed_runs):
    run, stderr = skewed_runs["off"]
    warned = re.findall(r"warning: step (\d+): MoE layer (\d+): expert (\d+) has received more "
                        r"than 2.5 x the mean load for 5 steps", stderr)
    assert warned, stderr[-2000:]
    recs = {r["step"]: r for r in records(run)}
    for step, layer, expert in warned:  # the expert named is that step's most loaded one
        load = recs[int(step)][f"moe.{layer}.load"]
        assert int(expert) == int(np.argmax(load))
        assert all(max_mean(run, layer)[s - 1] > 2.5 for s in range(int(step) - 4, int(step) + 1))


def test_plot_draws_the_expert_load_heat_map_of_the_metrics(skewed_runs, tmp_path):
    import shutil

    from hpctrain.metrics.moe_plot import load_matrices

    run = tmp_path / "on"  # the plot is written beside the metrics: a copy (the shared run is read-only)
    shutil.copytree(skewed_runs["on"][0], run)
    r = run_cmd([sys.executable, "-m", "hpctrain", "plot", run], timeout=120, check=True)
    assert str(run / "expert_load.png") in r.stdout.split()
    image = __import__("matplotlib.image").image.imread(run / "expert_load.png")
    assert image.shape[:2] == (560, 1100)  # 2 layers: (1.2 + 2 x 2.2) x 11 inches at 100 dpi
    matrices = load_matrices(records(run))
    assert list(matrices) == ["0", "1"]
    steps, matrix = matrices["1"]
    assert list(steps) == list(range(1, STEPS + 1)) and matrix.shape == (STEPS, 8)
    first = records(run)[0]["moe.1.load"]
    assert np.allclose(matrix[0], np.array(first) / np.mean(first))


def test_aux_loss_weighs_the_same_per_optimizer_step_under_grad_accumulation(tmp_path, one_play):
    """Micro-batches [b, b] (accumulated) and cat(b, b) (one) give the same router gradient: the
    aux loss is scaled like the main loss (1 / grad_accum), not counted once per micro-batch."""
    config = tmp_path / "moe.toml"
    config.write_text(CONFIG.format(run=tmp_path / "run", data=one_play))
    r = mpirun(1, [PROBE, "aux", config, "--model.moe_gate=softmax", "--model.moe_aux_loss_coef=0.5"],
               timeout=300, check=True)
    figures = dict(line.split() for line in r.stdout.splitlines() if line.count(" ") == 1)
    assert float(figures["aux_share"]) > 0.05  # the aux loss is a real part of the gradient
    assert float(figures["router_rel_diff"]) < 1e-5


def test_loads_are_summed_over_dp_and_every_pipeline_stages_layers_reach_the_record(tmp_path, one_play):
    """pp 2 x dp 2 (FSDP), 4 sparse layers, grad_accum 2: rank 0's record has the layers of both
    stages (gathered over pp), each layer's loads summed over the 2 dp ranks (all-reduce), and the
    sharded balancing bias of both stages moved."""
    config = tmp_path / "moe.toml"
    config.write_text(CONFIG.format(run=tmp_path / "run", data=one_play))
    mpirun(4, ["-m", "hpctrain", "train", "--config", config, "--train.steps=3",
               "--train.micro_batch_size=4", "--train.grad_accum=2", "--model.n_layer=4",
               "--model.moe_bias_update_rate=0.01", "--parallel.pp=2", "--parallel.data_parallel=fsdp"],
           timeout=300, check=True)
    steps = [r for r in records(tmp_path / "run") if "loss" in r]
    for rec in steps:
        for layer in "0123":  # 2 dp x 2 micro-batches x 4 sequences x 32 tokens, top 1
            routed = 2 * 2 * 4 * 32
            # step 1 also counts torch's pipeline schedule's one shape-inference forward per stage
            assert sum(rec[f"moe.{layer}.load"]) == routed or (rec["step"] == 1 and
                                                             sum(rec[f"moe.{layer}.load"]) > routed)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for layer in "0123":  # one bias step of 0.01: experts above the mean -0.01, below +0.01
        assert steps[0][f"moe.{layer}.bias_spread"] == pytest.approx(0.02)


def test_moe_metrics_are_read_at_log_steps_and_the_last_step_only(tmp_path, one_play):
    """#49: the monitor reads its numbers on the host at log steps only (train.log_interval 2)
    and at the run's last step (5): the moe.* keys are in steps 2, 4 and 5's records, the loss in
    every step's; each logged load counts that step's routed rows (top 1: 16 x 32 tokens)."""
    config = tmp_path / "moe.toml"
    config.write_text(CONFIG.format(run=tmp_path / "run", data=one_play))
    run_cmd([sys.executable, "-m", "hpctrain", "train", "--config", config, "--train.steps=5",
             "--train.log_interval=2"], timeout=300, check=True, env={"HPCTRAIN_THREADS": "1"})
    steps = [r for r in records(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in steps if "moe.0.load" in r] == [2, 4, 5]
    assert all(sum(r[f"moe.{layer}.load"]) == 16 * 32 for r in steps if "moe.0.load" in r for layer in "01")
