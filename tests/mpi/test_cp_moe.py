"""parallel.cp with expert parallelism (#51) under a real mpiexec, fp32 on CPUs: the ep ranks are
borrowed from the flattened dp x cp ranks (hpctrain/parallel/apply_expert.py), so a cp rank's
tokens (its zig-zag part of each sequence) are dispatched to the experts of the other dp and cp
ranks, and the expert gradients, the routing loads and the balancing bias' step are summed over
dp x cp. Every layout below trains the same curve as one rank (losses and validation losses
within 1e-5 relative), every routed row is counted once in the loads; and with
parallel.deterministic_experts a cp = 2 x ep = 2 run resumes bit-exactly (losses and grad norms)
and its checkpoint continues at cp = 1 (ep = 2 over dp = 2) on the uninterrupted curve.

The MoE layer is dropless (hpctrain/model/moe.py: no capacity, no token dropped), so splitting a
sequence over cp ranks changes no routing decision: nothing to refuse for parity.

Model: the cp parity llama (2 blocks, 64 wide, 32 tokens) with a 4-expert, top-2 MoE feed-forward
and DeepSeek-V3's auxiliary-loss-free balancing (model.moe_bias_update_rate), whose bias step is
the same on every rank only if the loads are summed over every rank of dp x cp.
"""
import pytest

from tests.conftest import losses, records
from tests.helpers import assert_same_curve, copy_run_at
from tests.helpers import train_layout as train
from tests.mpi.test_context_parallel_training import DP2, SHORT, STEPS, assert_matches, first_step
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi

MOE = ["--model.moe_experts=4", "--model.moe_top_k=2", "--model.moe_bias_update_rate=0.01"]
DETERMINISTIC = ["--parallel.deterministic_experts=true"]
# name: (ranks, overrides); dp x cp = 4 ranks read the same 8 sequences per step as one rank
LAYOUTS = {
    "dp2_cp2_ep2": (4, ["--parallel.cp=2", "--parallel.ep=2", *DP2]),  # an ep group = a cp group
    # across dp and cp; FSDP2 over dp x cp for the rest (the runner divides the expert gradients
    # by dp x cp: DDP's MPI hook divides the loss before backward instead)
    "fsdp2_cp2_ep4": (4, ["--parallel.cp=2", "--parallel.ep=4", "--parallel.data_parallel=fsdp", *DP2]),
}
ROUTED_ROWS = 8 * 32 * 2  # a step's sequences x tokens x top-2, per layer


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, speeches):
    """The 1-rank run dir, trained once per session (tests/shared_dirs.py). Read-only."""
    return shared_dir(tmp_path_factory, "cp_moe_one", lambda out: train(
        1, out, speeches, "run", *SHORT, *MOE)) / "run"


def assert_every_row_counted_and_biased(run):
    last = records(run)[-1]  # the last step's record (a log step)
    assert last["step"] == STEPS
    for layer in ("0", "1"):
        assert sum(last[f"moe.{layer}.load"]) == ROUTED_ROWS, last[f"moe.{layer}.load"]
        assert last[f"moe.{layer}.bias_spread"] > 0  # the balancing bias moved


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cp_with_ep_matches_one_rank(tmp_path, speeches, one_rank, layout):
    n, overrides = LAYOUTS[layout]
    _, run = train(n, tmp_path, speeches, layout, *SHORT, *MOE, *overrides)
    assert_matches(one_rank, run)
    assert_every_row_counted_and_biased(run)
    assert_same_curve(losses(one_rank, "grad_norm"), losses(run, "grad_norm"), range(1, STEPS + 1))


def test_deterministic_experts_at_cp2_resume_exactly_and_continue_at_cp1(tmp_path, speeches, one_rank):
    """dp2 x cp2 x ep2 with parallel.deterministic_experts (the expert gradients summed in one tree
    over the dp x cp index): one rank's curve; its step-3 checkpoint resumed at the same layout
    gives steps 4..6 bit-equal (losses and grad norms), at cp = 1 (2 ranks, dp2 x ep2) within 1e-5."""
    layout = [*SHORT, *MOE, *DP2, "--parallel.ep=2", *DETERMINISTIC]
    _, straight = train(4, tmp_path, speeches, "straight", *layout, "--parallel.cp=2")
    assert_matches(one_rank, straight)
    assert_every_row_counted_and_biased(straight)
    copy_run_at(straight, tmp_path / "again_cp2", 3)
    copy_run_at(straight, tmp_path / "at_cp1", 3)
    r, again = train(4, tmp_path, speeches, "again_cp2", *layout, "--parallel.cp=2")
    assert first_step(r) == 3
    later = range(4, STEPS + 1)
    for key in ("loss", "grad_norm"):
        whole, resumed = losses(straight, key), losses(again, key)
        assert sorted(resumed) == list(range(1, STEPS + 1))
        assert [resumed[s] for s in later] == [whole[s] for s in later], key
    r, cp1 = train(2, tmp_path, speeches, "at_cp1", *layout)
    assert first_step(r) == 3
    assert_same_curve(losses(straight), losses(cp1), range(1, STEPS + 1))
