"""Meta-device initialization (#21) under a real mpiexec: in every layout, the initial weights are
bit-identical to building the whole model on every rank (parallel.meta_init = false), and so are
the losses of 20 training steps (the meta-init side: test_parallel_parity.py's run of the layout).

The probe (scripts/meta_init_probe.py) builds the tiny GPT both ways in each layout and compares
each rank's parameters, gathered whole, with the other build's and with a plain CPU GPT.
"""
import tomllib

import pytest

from tests.conftest import ROOT, losses, mpirun
from tests.helpers import LAYOUTS, probe, shared_layout_run
from tests.helpers import train_layout as train

pytestmark = pytest.mark.mpi

def test_weights_identical_two_ranks():
    probe(2, {"dp2": "", "tp2": "parallel.tp=2", "pp2": "parallel.pp=2",
              "pp2_interleaved": "parallel.pp=2,parallel.pp_schedule=interleaved",
              "fsdp2": "parallel.data_parallel=fsdp",
              "fsdp2_ac": "parallel.data_parallel=fsdp,parallel.activation_checkpoint=full"})


@pytest.mark.slow
def test_weights_identical_four_ranks():
    probe(4, {"fsdp2_tp2": "parallel.tp=2,parallel.data_parallel=fsdp",
              "pp2_tp2": "parallel.pp=2,parallel.tp=2", "pp2_dp2": "parallel.pp=2",
              "dp2_tp2": "parallel.tp=2", "pp2_fsdp2": "parallel.pp=2,parallel.data_parallel=fsdp"})


@pytest.mark.parametrize("layout", ["one", "fsdp2", "pp2_1f1b",
                                    pytest.param("dp2", marks=pytest.mark.slow),
                                    pytest.param("tp2", marks=pytest.mark.slow)])
def test_losses_identical(tmp_path, tmp_path_factory, dataset, layout):  # noqa: F811
    """PARITY_GPT's 20 steps with parallel.meta_init true and false: the same losses, bit for bit.
    The true side (the default) is test_parallel_parity.py's run of the layout, trained once per
    session (tests/helpers.py shared_layout_run); only the false side is trained here."""
    n, overrides = (1, []) if layout == "one" else LAYOUTS[layout]
    _, meta_run = shared_layout_run(tmp_path_factory, dataset, layout)
    assert tomllib.loads((meta_run / "config.toml").read_text())["parallel"]["meta_init"] is True
    _, run = train(n, tmp_path, dataset, f"{layout}_false", *overrides, "--parallel.meta_init=false")
    got = {"true": losses(meta_run), "false": losses(run)}
    assert sorted(got["true"]) == list(range(1, 21)), got
    assert got["true"] == got["false"], got


def test_setup_memory_is_the_shard_plus_a_bounded_overhead():
    """FSDP over 4 ranks, 16 x 1024 wide, vocab 50304 (255M parameters, 1.02 GB whole in fp32,
    255 MB per rank): each rank's peak RSS grows by at most its shard + the largest whole parameter
    (+ its shard + 256 MB slack: bench/meta_init.py's BOUND), well below the whole model that every
    rank built before meta init."""
    r = mpirun(4, [ROOT / "bench" / "meta_init.py", "--n_layer=16", "--n_embd=1024", "--n_head=16"],
               timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [l.split()[1:] for l in r.stdout.splitlines() if l.startswith("RANK ") and "_MB" not in l]
    assert len(rows) == 4, r.stdout
    for rank, _, _, grown, shard, largest, whole, _ in rows:
        grown, shard, largest, whole = map(float, (grown, shard, largest, whole))
        assert shard < grown <= shard + largest + 256, (rank, grown, shard, largest)
        assert grown < 0.75 * whole, (rank, grown, whole)
    assert "BOUND ok" in r.stdout
