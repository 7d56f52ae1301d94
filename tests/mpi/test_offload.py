"""CPU offload (parallel.offload, issue 52) under a real mpiexec: FSDP2 with offload = "all"
(FSDP2's CPUOffloadPolicy) and "optimizer" (hpctrain/parallel/offload.py) trains bit-equal to
offload = "none", and checkpoints resume bit-exact across offload settings.

Bit-equal, not within a tolerance: on CPU the "device" is the host, and both modes run the same
fused AdamW kernel on the same fp32 values (copies move bytes, they do not round); the forward,
backward and FSDP2's collectives are the same ops in the same order.
PARITY_GPT (tests/helpers.py): 20 steps, checkpoints at 10 and 20, 8 sequences per step.
"""
import pytest

from tests.conftest import losses
from tests.helpers import LAYOUTS, copy_run_at, shared_layout_run
from tests.helpers import train_layout as train
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi

FSDP2 = LAYOUTS["fsdp2"]  # 2 ranks, FSDP2 over dp = 2
DP2 = LAYOUTS["dp2"]      # 2 ranks, DDP


def offloaded(tmp_path_factory, dataset, base: str, mode: str):
    """PARITY_GPT as LAYOUTS[base] with parallel.offload = mode: its run dir, trained once per
    session."""
    n, overrides = LAYOUTS[base]
    name = f"{base}_offload_{mode}"
    return shared_dir(tmp_path_factory, name, lambda out: train(
        n, out, dataset, name, *overrides, f"--parallel.offload={mode}")) / name


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory, dataset):
    return shared_layout_run(tmp_path_factory, dataset, "fsdp2")[1]


@pytest.mark.parametrize("mode", ["all", "optimizer"])
def test_fsdp2_offload_is_bit_equal_to_no_offload(tmp_path_factory, dataset, fsdp2_run, mode):
    """20 steps of FSDP2 over 2 ranks with offload = mode: every loss equal to offload = none's
    (and the run learns, so the curve is not a constant)."""
    ref, got = losses(fsdp2_run), losses(offloaded(tmp_path_factory, dataset, "fsdp2", mode))
    assert sorted(got) == list(range(1, 21))
    assert got == ref
    assert ref[20] < 0.75 * ref[1]


def test_ddp_optimizer_offload_is_bit_equal(tmp_path_factory, dataset):
    """offload = "optimizer" under DDP (each rank's whole AdamW state on the host): dp2's losses."""
    ref = losses(shared_layout_run(tmp_path_factory, dataset, "dp2")[1])
    assert losses(offloaded(tmp_path_factory, dataset, "dp2", "optimizer")) == ref


@pytest.mark.parametrize("saved,resumed", [("all", "none"), ("none", "all"),
                                           ("optimizer", "none"), ("none", "optimizer")])
def test_checkpoint_resumes_bit_exact_across_offload(tmp_path_factory, tmp_path, dataset, fsdp2_run,
                                                     saved, resumed):
    """A step-10 checkpoint written with offload = saved, resumed to step 20 with offload =
    resumed: steps 11-20 equal the uninterrupted offload = none run's (weights, AdamW moments and
    step counts, data position all restored)."""
    source = fsdp2_run if saved == "none" else offloaded(tmp_path_factory, dataset, "fsdp2", saved)
    name = f"resume_{resumed}"
    copy_run_at(source, tmp_path / name, 10)
    n, overrides = FSDP2
    r, run = train(n, tmp_path, dataset, name, *overrides, f"--parallel.offload={resumed}")
    assert "step_00000010" in r.stderr
    got = {s: v for s, v in losses(run).items() if s > 10}
    assert got == {s: v for s, v in losses(fsdp2_run).items() if s > 10}
    assert sorted(got) == list(range(11, 21))
