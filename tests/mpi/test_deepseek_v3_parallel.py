"""The DeepSeek-V3 family in the trainer under real mpiexec (#50): a small DeepseekV3ForCausalLM
built here (tests/unit/test_deepseek_v3.py's, 4 layers, the first dense; MLA with the query
bottleneck, 8 routed experts in 4 groups of which 2 are chosen, a shared expert, the correction
bias random) seeds every run by init.from; the balancing bias is trained (moe_bias_update_rate),
so the loads summed over the ranks steer it. Each layout's 6 steps against one rank's (same global
batch): loss within 1e-5 relative, grad norm within 1e-4, and it learns.
"""
from __future__ import annotations

import pytest

from tests.conftest import losses, mpirun, run_cmd
from tests.shared_dirs import shared_dir
from tests.unit.test_deepseek_v3 import make_hf

pytestmark = pytest.mark.mpi

STEPS = 6
CONFIG = """[run]
dir = "{run}"
[data]
path = "{data}"
verify = "size"
cache_dir = "off"
[init]
from = "{hf}"
[model]
block_size = 32
moe_bias_update_rate = 0.01
[train]
steps = 6
warmup_steps = 0
micro_batch_size = 2
global_batch = 8
eval_interval = 0
log_interval = 1
lr = 0.003
[checkpoint]
interval = 6
"""
LAYOUTS = {  # name: (ranks, overrides)
    "dp2": (2, []),
    "fsdp2": (2, ["--parallel.data_parallel=fsdp"]),
    "tp2": (2, ["--parallel.tp=2"]),
    "pp2": (2, ["--parallel.pp=2"]),
    "ep2": (2, ["--parallel.ep=2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, two_plays):
    """{layout: run dir} of the one-rank reference and every LAYOUTS entry, trained once per
    session: xdist splits the layouts' tests between its workers, and tests/shared_dirs.py lets the
    second read the first's runs."""
    import sys

    def train_all(tmp):
        make_hf(tmp / "hf", vocab_size=300, num_hidden_layers=4, max_position_embeddings=64)
        for name, (n, overrides) in {"one": (1, []), **LAYOUTS}.items():
            cfg = tmp / f"{name}.toml"
            cfg.write_text(CONFIG.format(run=tmp / name, data=two_plays, hf=tmp / "hf"))
            args = ["-m", "hpctrain", "train", "--config", cfg, *overrides]
            r = run_cmd([sys.executable, *args], timeout=400) if n == 1 else mpirun(n, args, timeout=400)
            assert r.returncode == 0, (name, r.stderr[-3000:])
    tmp = shared_dir(tmp_path_factory, "dsv3_layouts", train_all)
    return {name: tmp / name for name in ("one", *LAYOUTS)}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_as_one_rank(runs, layout):
    ref, got = losses(runs["one"]), losses(runs[layout])
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    assert max(_rel(got[s], ref[s]) for s in ref) <= 1e-5, (layout, got, ref)
    ref_norm, got_norm = losses(runs["one"], "grad_norm"), losses(runs[layout], "grad_norm")
    assert max(_rel(got_norm[s], ref_norm[s]) for s in ref) <= 1e-4, (got_norm, ref_norm)
    assert ref[STEPS] < ref[1] - 0.1  # it trains (5.79 -> 5.62)
