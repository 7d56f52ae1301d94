"""HSDP (parallel.dp_shard, issue 52) under a real mpiexec: FSDP2 on a 2-D (dp_replicate,
dp_shard) mesh reproduces the 1-rank curve, shards each parameter over dp_shard ranks only, and
its checkpoints resume in any layout (and any layout's in it) on the uninterrupted curve.

PARITY_GPT (tests/helpers.py): 8 sequences per step in every layout.
"""
import pytest

from hpctrain.checkpoint.safe_load import read_metadata
from tests.conftest import losses
from tests.helpers import LAYOUTS, assert_same_curve, copy_run_at, shared_layout_run
from tests.helpers import train_layout as train
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi

FSDP = ["--parallel.data_parallel=fsdp"]
DP4 = ["--train.micro_batch_size=2", "--train.grad_accum=1"]
HSDP = {  # name: (ranks, overrides)
    "hsdp2x2": (4, FSDP + ["--parallel.dp_shard=2"] + DP4),  # replicate 2 x shard 2
    "hsdp2x1_tp2": (4, FSDP + ["--parallel.dp_shard=1", "--parallel.tp=2", "--train.grad_accum=1"]),
    "hsdp2x1_cp2": (4, FSDP + ["--parallel.dp_shard=1", "--parallel.cp=2", "--train.grad_accum=1"]),
    "hsdp2x1_pp2": (4, FSDP + ["--parallel.dp_shard=1", "--parallel.pp=2", "--train.micro_batch_size=2",
                               "--train.grad_accum=2"]),
    "fsdp4": (4, FSDP + DP4),
    "ddp4": (4, DP4),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset):
    return losses(shared_layout_run(tmp_path_factory, dataset, "one")[1])


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory, dataset):
    """hsdp2x2's 20 steps (checkpoints at 10 and 20): its run dir, trained once per session
    (tests/shared_dirs.py; the tests read it and copy it before resuming)."""
    n, overrides = HSDP["hsdp2x2"]
    return shared_dir(tmp_path_factory, "hsdp2x2",
                      lambda out: train(n, out, dataset, "hsdp2x2", *overrides)) / "hsdp2x2"


def chunks_per_tensor(run, step: int) -> set[int]:
    """How many pieces each parameter of the step's checkpoint was saved in (DCP writes a
    replicated shard once): the ranks it was sharded over."""
    md = read_metadata(run / "checkpoints" / f"step_{step:08d}" / ".metadata")
    return {len(m.chunks) for k, m in md.state_dict_metadata.items() if k.startswith("model.blocks.")}


def test_hsdp_is_the_one_rank_curve_sharded_over_dp_shard(reference, hsdp_run):
    """4 ranks, dp_shard=2 x dp_replicate=2: the 1-rank curve (1e-5); each block parameter in 2
    shards (plain FSDP over 4 ranks: 4), so the mesh is the 2-D one, not dp."""
    assert_same_curve(reference, losses(hsdp_run), range(1, 21))
    assert reference[20] < 0.75 * reference[1]
    assert chunks_per_tensor(hsdp_run, 10) == {2}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["hsdp2x1_tp2", "hsdp2x1_cp2", "hsdp2x1_pp2"])
def test_hsdp_composes(tmp_path, dataset, reference, layout):
    """dp_replicate=2 x dp_shard=1 beside tp=2, cp=2 (FSDP shards over dp_shard x cp) or pp=2: the
    1-rank curve."""
    n, overrides = HSDP[layout]
    _, run = train(n, tmp_path, dataset, layout, *overrides)
    assert_same_curve(reference, losses(run), range(1, 21))


@pytest.mark.parametrize("target", ["hsdp2x2", "fsdp4", "ddp4"])
def test_hsdp_checkpoint_resumes_in_any_layout(tmp_path, dataset, reference, hsdp_run, target):
    """HSDP's step-10 checkpoint resumed to step 20 as HSDP (bit-equal to the uninterrupted run),
    plain FSDP over 4 and DDP over 4 (the 1-rank curve: weights, AdamW state, data position)."""
    copy_run_at(hsdp_run, tmp_path / target, 10)
    n, overrides = HSDP[target]
    r, run = train(n, tmp_path, dataset, target, *overrides)
    assert "resumed from" in r.stderr and "step_00000010" in r.stderr
    got = {s: v for s, v in losses(run).items() if s > 10}
    assert_same_curve(reference, got, range(11, 21))
    if target == "hsdp2x2":
        assert got == {s: v for s, v in losses(hsdp_run).items() if s > 10}


def test_a_tp_checkpoint_resumes_as_hsdp(tmp_path_factory, tmp_path, dataset, reference):
    """dp2_tp2's step-10 checkpoint (DDP x TP) resumed as HSDP 2 x 2: the 1-rank curve."""
    source = shared_layout_run(tmp_path_factory, dataset, "dp2_tp2")[1]
    assert LAYOUTS["dp2_tp2"][0] == 4
    copy_run_at(source, tmp_path / "hsdp2x2", 10)
    n, overrides = HSDP["hsdp2x2"]
    r, run = train(n, tmp_path, dataset, "hsdp2x2", *overrides)
    assert "step_00000010" in r.stderr
    assert_same_curve(reference, {s: v for s, v in losses(run).items() if s > 10}, range(11, 21))
    assert chunks_per_tensor(run, 20) == {2}
