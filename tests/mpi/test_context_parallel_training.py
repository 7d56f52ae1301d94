"""parallel.cp in the trainer (#51) under a real mpiexec, fp32 on CPUs: every layout below trains the
same curve as one rank (losses and the validation losses at steps 0 and 6 within 1e-5 relative),
so the zig-zag split of the loader, the tokens' global (or per-document) positions, the ring /
Ulysses attention inside every layer, the gradient average over dp x cp and the loss mean over
dp x cp are all right; and checkpoints of a cp = 2 run resume bit-exactly at cp = 2 and continue at
cp = 1 on the uninterrupted curve (cp ranks are replicas: nothing of cp is in a checkpoint).

Models: the parity llama (2 blocks, 64 wide, 32 tokens, 4 heads) and the same with a 4-expert,
top-2 MoE feed-forward; with and without data.document_mask (+ document_positions) on
Shakespeare's first play cut into its speeches (most windows hold several documents).
"""
import re

import pytest

from tests.conftest import losses, records
from tests.helpers import assert_same_curve, copy_run_at
from tests.helpers import train_layout as train
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi

STEPS = 6
SHORT = [f"--train.steps={STEPS}", "--model.n_layer=2", "--checkpoint.interval=3",
         f"--train.eval_interval={STEPS}", "--train.eval_batches=2", "--model.arch=llama"]
MODELS = {"dense": [], "moe": ["--model.moe_experts=4", "--model.moe_top_k=2"],
          "tied": ["--model.tie_embeddings=true"],
          "deep": ["--model.n_layer=4"]}  # 4 blocks: pp = 2 x 2 virtual stages  # the embedding / head weight on both pp ends
MASK = {"off": [], "on": ["--data.document_mask=true", "--data.document_positions=true"]}
# dp = 2: the same 8 sequences per step and the same 8 validation windows (eval_batches x micro x dp)
DP2 = ["--train.grad_accum=1", "--train.eval_batches=1"]
# pp = 2 x cp = 2 (4 ranks; the default 2 micro-batches of 4 sequences per step)
PP2_CP2 = ["--parallel.pp=2", "--parallel.cp=2"]
# name: (ranks, model, mask, overrides); together with the resume test's straight run (cp = 2,
# dense, unmasked): cp 2 and 4, dense and MoE, masked and not, ring and Ulysses, cp with dp (DDP
# and FSDP2) and with tp, and activation checkpointing (the ring recomputed inside backward)
LAYOUTS = {
    "cp4_dense_masked": (4, "dense", "on", ["--parallel.cp=4"]),
    "cp2_moe_masked": (2, "moe", "on", ["--parallel.cp=2"]),
    "cp4_moe_ac": (4, "moe", "off", ["--parallel.cp=4", "--parallel.activation_checkpoint=full"]),
    "dp2_cp2_ulysses_masked": (4, "dense", "on", ["--parallel.cp=2", "--parallel.cp_attention=ulysses",
                                                 *DP2]),
    "fsdp2_cp2": (4, "dense", "off", ["--parallel.cp=2", "--parallel.data_parallel=fsdp", *DP2]),
    "tp2_cp2_masked": (4, "dense", "on", ["--parallel.cp=2", "--parallel.tp=2"]),
    # pp x cp: every stage's micro-batch (and the activations between stages) is the cp part
    "pp2_cp2_gpipe_masked": (4, "dense", "on", [*PP2_CP2, "--parallel.pp_schedule=gpipe"]),
    "pp2_cp2_1f1b_moe_masked": (4, "moe", "on", [*PP2_CP2, "--parallel.pp_schedule=1f1b"]),
    "pp2_cp2_interleaved": (4, "deep", "off", [*PP2_CP2, "--parallel.pp_schedule=interleaved",
                                               "--parallel.pp_virtual_stages=2"]),
}


@pytest.fixture(scope="module")
def dataset(speeches):
    """The first play's speeches, one document each (conftest's `speeches`)."""
    return speeches


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, dataset):
    """(model, mask) -> the 1-rank run dir, trained on first use, once per session
    (tests/shared_dirs.py: both xdist workers read it). Read-only."""
    def run(model: str, mask: str):
        name = f"cp_one_{model}_{mask}"
        return shared_dir(tmp_path_factory, name, lambda out: train(
            1, out, dataset, "run", *SHORT, *MODELS[model], *MASK[mask])) / "run"
    return run


def assert_matches(ref_run, run):
    ref = losses(ref_run)
    assert_same_curve(ref, losses(run), range(1, STEPS + 1))
    ref_val, val = losses(ref_run, "val_loss"), losses(run, "val_loss")
    assert sorted(val) == sorted(ref_val) == [0, STEPS]  # before training and at the end
    assert all(abs(val[s] - ref_val[s]) <= 1e-5 * ref_val[s] for s in val), (ref_val, val)
    assert ref[STEPS] < 0.9 * ref[1]  # it learns


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cp_layouts_match_one_rank(tmp_path, dataset, one_rank, layout):
    n, model, mask, overrides = LAYOUTS[layout]
    _, run = train(n, tmp_path, dataset, layout, *SHORT, *MODELS[model], *MASK[mask], *overrides)
    assert_matches(one_rank(model, mask), run)


def test_cp2_matches_one_rank_resumes_exactly_and_continues_at_cp1(tmp_path, dataset, one_rank):
    """A cp = 2 run (dense, unmasked) on one rank's curve; its step-3 checkpoint: at cp = 2 steps
    4..6 bit-equal to the straight run's, at cp = 1 (one rank) within 1e-5 of it."""
    _, straight = train(2, tmp_path, dataset, "straight", *SHORT, "--parallel.cp=2")
    assert_matches(one_rank("dense", "off"), straight)
    # the ring's exchanges wait inside forward/backward: busy time is wall time, nobody flagged
    steps = [r for r in records(straight) if "rank_busy_s" in r]
    assert len(steps) == STEPS and all(r.get("rank_busy_measure") == "wall" for r in steps)
    whole = losses(straight)
    copy_run_at(straight, tmp_path / "again_cp2", 3)
    copy_run_at(straight, tmp_path / "at_cp1", 3)
    r, again = train(2, tmp_path, dataset, "again_cp2", *SHORT, "--parallel.cp=2")
    assert first_step(r) == 3
    resumed = losses(again)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert [resumed[s] for s in range(4, STEPS + 1)] == [whole[s] for s in range(4, STEPS + 1)]
    r, cp1 = train(1, tmp_path, dataset, "at_cp1", *SHORT)
    assert first_step(r) == 3
    assert_same_curve(whole, losses(cp1), range(1, STEPS + 1))


def first_step(process) -> int:
    """The step a run started from (its start-up line's "steps N -> M of M")."""
    return int(re.search(r"steps (\d+) -> \d+ of ", process.stderr).group(1))


def test_pp2_cp2_matches_one_rank_resumes_exactly_and_continues_at_pp2_cp1(tmp_path, dataset, one_rank):
    """A pp = 2 x cp = 2 run (1f1b, tied embeddings: their gradient summed over the first and last
    stage of each cp rank, masked) on one rank's curve; its step-3 checkpoint: at pp2 x cp2 steps
    4..6 bit-equal to the straight run's, at pp2 x cp1 (2 ranks) within 1e-5 of it."""
    layout = [*MODELS["tied"], *MASK["on"], "--parallel.pp=2", "--parallel.pp_schedule=1f1b"]
    _, straight = train(4, tmp_path, dataset, "straight", *SHORT, *layout, "--parallel.cp=2")
    assert_matches(one_rank("tied", "on"), straight)
    whole = losses(straight)
    copy_run_at(straight, tmp_path / "again_cp2", 3)
    copy_run_at(straight, tmp_path / "at_cp1", 3)
    r, again = train(4, tmp_path, dataset, "again_cp2", *SHORT, *layout, "--parallel.cp=2")
    assert first_step(r) == 3
    resumed = losses(again)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert [resumed[s] for s in range(4, STEPS + 1)] == [whole[s] for s in range(4, STEPS + 1)]
    r, cp1 = train(2, tmp_path, dataset, "at_cp1", *SHORT, *layout)
    assert first_step(r) == 3
    assert_same_curve(whole, losses(cp1), range(1, STEPS + 1))
