"""bench/moe.py and configs/moe_recipe.toml (#34) run: `bench/moe.py --smoke` times one toy MoE
layer on 2 ranks (experts replicated vs ep = 2 over a real mpiexec, the all-to-all alone) and
trains the recipe's MoE (at a smaller width) for 12 steps through the real CLI. Asserted: ep = 2
computes what the replicated layer computes and every routed row once (dropless: 64 tokens x 2
ranks x top-2), the recipe is really sparse (over 2x the dense twin's parameters at the same
active count), the dense twin gets the steps of the measured step-time ratio, and the loss falls."""
from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import ROOT, run_cmd


@pytest.mark.mpi
def test_moe_bench_smoke_runs_the_layer_and_the_recipe(dataset):
    r = run_cmd([sys.executable, ROOT / "bench/moe.py", "--smoke", "--part", "layer,recipe", "--data", dataset],
                timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    (layer,) = result["layer"]
    assert layer["out_diff"] <= 1e-5, layer
    assert layer["rows_computed"] == layer["rows_routed"] == 64 * 2 * 2, layer
    assert layer["ep_ms"] > layer["a2a_ms"] > 0 and 0 < layer["a2a_share"] < 1, layer
    recipe = result["recipe"]
    moe, dense = recipe["params"]["moe"], recipe["params"]["dense"]
    assert moe["total"] > 2 * dense["total"], recipe["params"]  # 8 experts, not a dense FFN
    # the same active parameters but for the routers (2 layers x 8 experts x (64 weights + 1 bias))
    assert moe["active"] - dense["active"] == 2 * 8 * 65, recipe["params"]
    assert recipe["steps"]["dense"] == max(1, round(12 * recipe["step_time_ratio"])), recipe["steps"]
    (run,) = recipe["runs"]["moe"]
    assert run["steps"] == 12 and run["curve"][-1][0] == 12, run
    assert run["last_loss"] < run["first_loss"] - 0.5, run
    assert run["val"] < run["curve"][0][2] - 0.5, run
