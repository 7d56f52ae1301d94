"""Hybrid parallelism under a real mpiexec: every layout reproduces the 1-rank loss curve, checkpoints
reshard across layouts and world sizes, bf16 learns in every layout, bad layouts fail in one line.

A tiny GPT (4 blocks, 64 wide, 32 tokens, 257 byte vocab) on Shakespeare, fp32, fixed seed, and
the same global batch (8 sequences) in every layout: micro_batch x grad_accum x dp = 8.
"""
import pytest

from tests.conftest import losses
from tests.helpers import LAYOUTS, assert_same_curve, copy_run_at, shared_layout_run
from tests.helpers import train_layout as train

pytestmark = pytest.mark.mpi

# The slowest on 2 cores (DTensor start-up, 4 oversubscribed ranks); still run in CI.
SLOW = {"pp2_gpipe", "pp2_interleaved", "dp2_tp2", "fsdp2_tp2", "pp2_tp2", "fsdp2_compile", "tp2_compile"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset):
    """The uninterrupted 1-rank curve (micro_batch 4 x grad_accum 2), trained once per session
    (tests/helpers.py shared_layout_run: xdist's workers and test_meta_init.py share it)."""
    return losses(shared_layout_run(tmp_path_factory, dataset, "one")[1])


@pytest.fixture(scope="module")
def dp2_tp2(tmp_path_factory, dataset):
    """The dp2_tp2 layout's 20 steps (checkpoints at 10 and 20), test_reshard_resume's source (its
    step-10 checkpoint): its run dir, trained once per session."""
    return shared_layout_run(tmp_path_factory, dataset, "dp2_tp2")[1]


@pytest.mark.parametrize("layout", [pytest.param(k, marks=[pytest.mark.slow] * (k in SLOW)
                                                 + [pytest.mark.compiles] * k.endswith("_compile"))
                                    for k in LAYOUTS])
def test_loss_parity(tmp_path_factory, dataset, reference, layout):
    """Each layout's 20 steps, trained once per session (test_meta_init.py reads some as its
    parallel.meta_init = true runs), are the 1-rank curve."""
    stderr, run = shared_layout_run(tmp_path_factory, dataset, layout)
    assert "training:" in stderr
    assert_same_curve(reference, losses(run), range(1, 21))
    assert reference[20] < 0.75 * reference[1]  # and it learns


@pytest.mark.parametrize("target", [pytest.param("dp4", marks=pytest.mark.slow),
                                    pytest.param("pp2_dp2", marks=pytest.mark.slow), "one"])
def test_reshard_resume(tmp_path_factory, dataset, reference, dp2_tp2, target):
    """Save at step 10 with tp=2 x dp=2 (the dp2_tp2 run, its step-20 checkpoint and records after
    step 10 removed); resume to 20 with another layout / world size: the resumed curve is the
    uninterrupted 1-rank curve (weights, AdamW state and data position all carried)."""
    tmp = tmp_path_factory.mktemp(f"reshard_{target}")
    copy_run_at(dp2_tp2, tmp / target, 10)
    n, overrides = {"dp4": (4, ["--train.micro_batch_size=2", "--train.grad_accum=1"]),
                    "pp2_dp2": (4, ["--parallel.pp=2", "--train.micro_batch_size=2", "--train.grad_accum=2"]),
                    "one": (1, [])}[target]
    r, run = train(n, tmp, dataset, target, *overrides)
    assert "resumed from" in r.stderr and "step_00000010" in r.stderr
    got = losses(run)
    assert_same_curve(reference, {s: v for s, v in got.items() if s > 10}, range(11, 21))
    assert_same_curve(reference, {s: v for s, v in got.items() if s <= 10}, range(1, 11))


def test_resume_with_another_global_batch_is_refused(tmp_path, dataset, dp2_tp2):
    """dp2_tp2's step-10 checkpoint (global batch 4 x 2 = 8) resumed on 1 rank with grad_accum 1 (4)."""
    copy_run_at(dp2_tp2, tmp_path / "gb", 10)
    r, _ = train(1, tmp_path, dataset, "gb", "--train.grad_accum=1", check=False)
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
