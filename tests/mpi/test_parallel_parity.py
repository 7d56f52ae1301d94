"""Hybrid parallelism under a real mpiexec: every layout reproduces the 1-rank loss curve, checkpoints
reshard across layouts and world sizes, bf16 learns in every layout, bad layouts fail in one line.

A tiny GPT (4 blocks, 64 wide, 32 tokens, 257 byte vocab) on Shakespeare, fp32, fixed seed, and
the same global batch (8 sequences) in every layout: micro_batch x grad_accum x dp = 8.
"""
import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import mpirun, run_cmd

pytestmark = pytest.mark.mpi

CONFIG = """
[run]
dir = "{run}"
[data]
path = "{data}"
verify = "size"
[model]
n_layer = 4
n_head = 4
n_embd = 64
block_size = 32
vocab_size = 257
[train]
steps = 20
micro_batch_size = 4
grad_accum = 2
lr = 3e-3
min_lr = 3e-4
warmup_steps = 5
eval_interval = 0
log_interval = 10
[checkpoint]
interval = 10
keep = 2
"""

# name: (ranks, overrides); every layout keeps the global batch at 8 sequences.
PP = ["--parallel.pp=2", "--train.micro_batch_size=2", "--train.grad_accum=4"]
LAYOUTS = {
    "dp2": (2, ["--train.grad_accum=1"]),
    "fsdp2": (2, ["--parallel.data_parallel=fsdp", "--train.grad_accum=1"]),
    "tp2": (2, ["--parallel.tp=2", "--train.micro_batch_size=8", "--train.grad_accum=1"]),
    "pp2_gpipe": (2, PP + ["--parallel.pp_schedule=gpipe"]),
    "pp2_1f1b": (2, PP + ["--parallel.pp_schedule=1f1b"]),
    "pp2_interleaved": (2, PP + ["--parallel.pp_schedule=interleaved", "--parallel.pp_virtual_stages=2"]),
    "dp2_tp2": (4, ["--parallel.tp=2", "--train.grad_accum=1"]),
    "fsdp2_tp2": (4, ["--parallel.tp=2", "--parallel.data_parallel=fsdp", "--train.grad_accum=1"]),
    "pp2_dp2": (4, ["--parallel.pp=2", "--train.micro_batch_size=2", "--train.grad_accum=2"]),
    "pp2_tp2": (4, PP + ["--parallel.tp=2"]),
    "dp2_ac_selective": (2, ["--train.grad_accum=1", "--parallel.activation_checkpoint=selective",
                             "--parallel.ac_every=2"]),
    # torch.compile (fused kernels round differently from eager, well inside the 1e-5 bound)
    "dp2_compile": (2, ["--train.grad_accum=1", "--train.compile=true"]),
    "fsdp2_compile": (2, ["--parallel.data_parallel=fsdp", "--train.grad_accum=1", "--train.compile=true"]),
    "tp2_compile": (2, ["--parallel.tp=2", "--train.micro_batch_size=8", "--train.grad_accum=1",
                        "--train.compile=true"]),
}
# The slowest on 2 cores (DTensor start-up, 4 oversubscribed ranks); still run in CI.
SLOW = {"pp2_gpipe", "pp2_interleaved", "dp2_tp2", "fsdp2_tp2", "pp2_tp2", "fsdp2_compile", "tp2_compile"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from data_tools.corpora import shakespeare_files

    plays = sorted(shakespeare_files())[:6]
    out = tmp_path_factory.mktemp("pdata") / "tiny"
    run_cmd([sys.executable, "-m", "data_tools", "shard", "--input", *plays, "--output", out,
             "--tokenizer", "bytes", "--shard-tokens", "400000", "--val-fraction", "0.2", "--seed", "3"],
            timeout=300, check=True)
    return out


def train(n, tmp, data, name, *overrides, check=True, timeout=300):
    run = Path(tmp) / name
    cfg = Path(tmp) / f"{name}.toml"
    if not cfg.exists():
        cfg.write_text(CONFIG.format(run=run, data=data))
    args = ["-m", "hpctrain", "train", "--config", cfg, *overrides]
    r = (run_cmd([sys.executable, *args], timeout=timeout, check=check) if n == 1
         else mpirun(n, args, timeout=timeout, check=check))
    return r, run


def losses(run):
    recs = [json.loads(l) for l in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def assert_same_curve(ref, got, steps):
    assert sorted(got) == list(steps), sorted(got)
    for s in steps:
        assert abs(got[s] - ref[s]) <= 1e-5 * abs(ref[s]), (s, ref[s], got[s])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset):
    """The uninterrupted 1-rank curve (micro_batch 4 x grad_accum 2)."""
    tmp = tmp_path_factory.mktemp("ref")
    _, run = train(1, tmp, dataset, "one")
    return losses(run)


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k
                                    for k in LAYOUTS])
def test_loss_parity(tmp_path, dataset, reference, layout):
    n, overrides = LAYOUTS[layout]
    r, run = train(n, tmp_path, dataset, layout, *overrides)
    assert "training:" in r.stderr
    assert_same_curve(reference, losses(run), range(1, 21))
    assert reference[20] < 0.75 * reference[1]  # and it learns


@pytest.mark.parametrize("target", [pytest.param("dp4", marks=pytest.mark.slow),
                                    pytest.param("pp2_dp2", marks=pytest.mark.slow), "one"])
def test_reshard_resume(tmp_path_factory, dataset, reference, target):
    """Save at step 10 with tp=2 x dp=2; resume to 20 with another layout / world size: the resumed
    curve is the uninterrupted 1-rank curve (weights, AdamW state and data position all carried)."""
    src = tmp_path_factory.getbasetemp() / "reshard_src"
    if not (src / "src" / "checkpoints").exists():
        src.mkdir(exist_ok=True)
        train(4, src, dataset, "src", "--parallel.tp=2", "--train.grad_accum=1", "--train.stop_at_step=10")
    tmp = tmp_path_factory.mktemp(f"reshard_{target}")
    shutil.copytree(src / "src", tmp / target)
    n, overrides = {"dp4": (4, ["--train.micro_batch_size=2", "--train.grad_accum=1"]),
                    "pp2_dp2": (4, ["--parallel.pp=2", "--train.micro_batch_size=2", "--train.grad_accum=2"]),
                    "one": (1, [])}[target]
    r, run = train(n, tmp, dataset, target, *overrides)
    assert "resumed from" in r.stderr and "step_00000010" in r.stderr
    got = losses(run)
    assert_same_curve(reference, {s: v for s, v in got.items() if s > 10}, range(11, 21))
    assert_same_curve(reference, {s: v for s, v in got.items() if s <= 10}, range(1, 11))


def test_resume_with_another_global_batch_is_refused(tmp_path, dataset):
    train(2, tmp_path, dataset, "gb", "--train.grad_accum=1", "--train.stop_at_step=10",
          "--train.steps=10")
    r, _ = train(1, tmp_path, dataset, "gb", "--train.grad_accum=1", "--train.steps=10", check=False)
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error:") and "global batch" in line and "8" in line and "4" in line


@pytest.mark.parametrize("n, overrides, expect", [
    (4, ["--parallel.tp=3"], "tp=3"),
    (4, ["--parallel.dp=3"], "dp=3 x tp=1 x pp=1 = 3 does not match the world size 4"),
    (4, ["--parallel.pp=8"], "model.n_layer=4"),
    (4, ["--parallel.tp=4", "--model.n_head=2"], "model.n_head=2"),
    (2, ["--parallel.pp=2", "--parallel.pp_schedule=interleaved", "--parallel.pp_virtual_stages=4"],
     "8 pipeline stages"),
    (2, ["--parallel.pp=2", "--train.compile=true"], "config key 'train.compile'"),
])
def test_bad_layout_is_one_line(tmp_path, dataset, n, overrides, expect):
    r, run = train(n, tmp_path, dataset, "bad", *overrides, check=False, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [l for l in r.stderr.splitlines() if "error" in l.lower()]  # (+ mpiexec's Abort notice)
    assert len(errors) == 1 and errors[0].startswith("error:") and expect in errors[0], r.stderr
    assert "Traceback" not in r.stderr and "training:" not in r.stderr
    assert not (run / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2_tp2", "pp2_dp2"])
def test_bf16_learns(tmp_path, dataset, layout):
    """bf16 in composite layouts (FSDP2 mixed precision x TP; pipeline x DDP); every layout's bf16
    run is recorded in docs/benchmarks.md."""
    n, overrides = LAYOUTS[layout]
    _, run = train(n, tmp_path, dataset, layout, *overrides, "--train.precision=bf16", "--train.steps=30")
    got = losses(run)
    first, last = sum(got[s] for s in (1, 2, 3)) / 3, sum(got[s] for s in (28, 29, 30)) / 3
    assert last < 0.75 * first, (layout, first, last)
