"""Document masking under a real mpiexec: data.document_mask (+ document_positions) trains the
same curve on dp2 (reading the shards' doc_offsets from the node cache), tp2, pp2 (every schedule)
and pp2 x dp2 as on 1 rank, and a different one from the unmasked run.

The parity model (4 blocks, 64 wide, 32 tokens; llama: rotary positions work under tp) on
Shakespeare's first play cut into its speeches
(one JSONL document each, ~40 bytes long: most 33-token windows hold several documents).
"""

import pytest

from tests.conftest import losses
from tests.helpers import assert_same_curve
from tests.helpers import train_layout as train
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi

LLAMA = ["--model.arch=llama"]
# validation at steps 0, 10 and 20 on 3 micro-batches of micro_batch_size x dp windows
MASK = [*LLAMA, "--data.document_mask=true", "--data.document_positions=true",
        "--train.eval_interval=10", "--train.eval_batches=3"]
PP = ["--parallel.pp=2", "--train.micro_batch_size=2", "--train.grad_accum=4"]  # 8 sequences a step


@pytest.fixture(scope="module")
def dataset(speeches):
    """The first play's speeches, one document each (conftest's `speeches`)."""
    return speeches


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, dataset):
    """The 1-rank masked run (micro_batch 4 x grad_accum 2), trained once per session (xdist
    splits the tests that read it between its workers)."""
    tmp = shared_dir(tmp_path_factory, "masked_one", lambda out: train(1, out, dataset, "one", *MASK))
    return tmp / "one"


@pytest.fixture(scope="module")
def reference(reference_run):
    """The 1-rank masked curve."""
    return losses(reference_run)


@pytest.mark.parametrize("layout, n, overrides", [
    ("dp2", 2, ["--train.grad_accum=1", "--data.cache_dir={tmp}/cache"]),  # offsets from the cache
    ("tp2", 2, ["--parallel.tp=2", "--train.micro_batch_size=8", "--train.grad_accum=1"]),
    # the later stages' attention sees the ids too (every schedule; with dp)
    ("pp2_gpipe", 2, [*PP, "--parallel.pp_schedule=gpipe"]),
    ("pp2_interleaved", 2, [*PP, "--parallel.pp_schedule=interleaved",
                            "--parallel.pp_virtual_stages=2"]),
    ("pp2_dp2", 4, ["--parallel.pp=2", "--train.micro_batch_size=2", "--train.grad_accum=2"]),
])
def test_masked_layouts_match_one_rank(tmp_path, dataset, reference, layout, n, overrides):
    overrides = [o.format(tmp=tmp_path) for o in overrides]
    _, run = train(n, tmp_path, dataset, layout, *MASK, *overrides)
    assert_same_curve(reference, losses(run), range(1, 21))
    assert reference[20] < 0.8 * reference[1]  # it learns


def test_pipeline_validation_matches_one_rank(tmp_path, dataset, reference_run, reference):
    """1F1B on the reference's micro-batches (2 of 4): the same validation windows, evaluated 2
    micro-batches per schedule call (the third call padded); the ids reach both stages there too."""
    _, run = train(2, tmp_path, dataset, "pp2_1f1b", *MASK, "--parallel.pp=2",
                   "--parallel.pp_schedule=1f1b")
    assert_same_curve(reference, losses(run), range(1, 21))
    assert_same_curve(losses(reference_run, "val_loss"), losses(run, "val_loss"), [0, 10, 20])


def test_mask_changes_the_numbers(tmp_path, dataset, reference):
    _, run = train(1, tmp_path, dataset, "unmasked", *LLAMA)
    plain = losses(run)
    assert max(abs(plain[s] - reference[s]) for s in range(2, 21)) > 1e-3


def test_learned_positions_under_tp_are_refused_in_one_line(tmp_path, dataset):
    r, _ = train(2, tmp_path, dataset, "gpt2_tp2", "--data.document_mask=true",
                 "--data.document_positions=true", "--parallel.tp=2", "--train.micro_batch_size=8",
                 "--train.grad_accum=1", check=False)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if "config key 'data.document_positions'" in line]
    assert errors and "parallel.tp=2" in errors[0], r.stderr[-2000:]
